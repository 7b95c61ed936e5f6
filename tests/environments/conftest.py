"""An in-process environment service served over a real gRPC socket on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from podrl.common.processes import free_port
from podrl.common.service import ServiceProcess
from podrl.config import RunConfig
from podrl.environments.main import build_spec
from podrl.v1 import environment_pb2_grpc
from tests.foundation.run_secret import authed_channel

FAULTY = "tests.environments.faulty_environments:Faulty"


def environments_config(**environments: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "worker_id": "test-worker",
            "environments": {"grpc_port": free_port(), "metrics_port": 0, **environments},
        }
    )


class RunningEnvironments:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.process = ServiceProcess(build_spec(config), config)
        self.process.start()
        self.address = f"127.0.0.1:{config.environments.grpc_port}"
        self.channel = authed_channel(self.address)
        self.stub = environment_pb2_grpc.EnvironmentStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.process.shutdown("test finished")


@pytest.fixture
def start_environments() -> Iterator[Callable[..., RunningEnvironments]]:
    started: list[RunningEnvironments] = []

    def start(**environments: Any) -> RunningEnvironments:
        started.append(RunningEnvironments(environments_config(**environments)))
        return started[-1]

    yield start
    for service in started:
        service.stop()
