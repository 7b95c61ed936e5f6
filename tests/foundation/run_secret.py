"""Clients of the suite's services: every test service gets the run secret the suite sets in
its environment (tests/conftest.py; ``podrl up`` clusters write their own), and these channels
carry credentials made from it."""

from __future__ import annotations

import os
from collections.abc import Mapping

import grpc

from podrl.common.auth import CONTROLLER, CallerCredentials
from podrl.common.grpc_options import open_channel
from podrl.config.auth import AuthConfig
from podrl.config.transport import GrpcConfig

#: The worker id the tests' controller-role clients claim.
TEST_CALLER_ID = "test-client"


def credentials(
    role: str = CONTROLLER, worker_id: str = TEST_CALLER_ID, env: Mapping[str, str] | None = None
) -> CallerCredentials:
    found = CallerCredentials.for_role(role, worker_id, AuthConfig(), env or os.environ)
    assert found is not None  # AuthConfig() is enabled: it raised if no secret is set
    return found


def authed_channel(
    address: str, role: str = CONTROLLER, worker_id: str = TEST_CALLER_ID
) -> grpc.Channel:
    """A channel to ``address`` whose calls carry ``role``'s credentials (the controller's by
    default: tests drive the workers the way the controller does)."""
    return open_channel(address, GrpcConfig(), credentials(role, worker_id))
