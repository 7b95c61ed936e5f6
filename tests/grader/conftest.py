"""An in-process grader served over a real gRPC socket on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from podrl.common.processes import free_port
from podrl.common.service import ServiceProcess
from podrl.config import RunConfig
from podrl.grader.main import build_spec
from tests.foundation.run_secret import authed_channel


def grader_config(tasks: list[dict[str, Any]], **grader: Any) -> RunConfig:
    return RunConfig.model_validate(
        {
            "worker_id": "test-worker",
            # Nothing listens there: membership registration fails fast and retries quietly.
            "controller": {"grpc_port": free_port()},
            "grader": {"grpc_port": free_port(), "metrics_port": 0, **grader},
            "tasks": {"definitions": tasks},
        }
    )


class RunningGrader:
    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.process = ServiceProcess(build_spec(config), config)
        self.process.start()
        self.address = f"127.0.0.1:{config.grader.grpc_port}"
        self.channel = authed_channel(self.address)
        self.stopped = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.channel.close()
            self.process.shutdown("test finished")


@pytest.fixture
def start_grader() -> Iterator[Callable[[RunConfig], RunningGrader]]:
    started: list[RunningGrader] = []

    def start(config: RunConfig) -> RunningGrader:
        started.append(RunningGrader(config))
        return started[-1]

    yield start
    for grader in started:
        grader.stop()
