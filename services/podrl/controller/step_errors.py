"""How a step or a run fails, and how RPC errors are described in those failures."""

from __future__ import annotations

import grpc


class StepFailedError(RuntimeError):
    """One attempt of a step failed in ``phase``; nothing of it was kept."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(f"{phase}: {message}")
        self.phase = phase


class RunFailedError(RuntimeError):
    """The run cannot go on (retries exhausted, trainer lost, inconsistent state)."""


def describe_rpc_error(err: grpc.RpcError) -> str:
    return f"{err.code().name}: {err.details()}"  # type: ignore[attr-defined]


#: The worker could not be reached (as opposed to an answer that refused the call).
TRANSPORT_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
