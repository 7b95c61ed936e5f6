"""Fixtures several controller test modules share: the real grader and fake pods of the loop
tests (tests/controller/fake_pod_loop.py, fake_cluster.py) and the served REST app with a
scaler (tests/controller/rest_scaling.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from podrl.common.processes import free_port
from podrl.common.service import ServiceProcess
from podrl.grader.main import build_spec as build_grader
from tests.controller.fake_cluster import Cluster
from tests.controller.fake_pod_loop import ConfigFor, RunLoop, loop_config, run_fake_pod_loop
from tests.controller.fake_workers import FakePod, FakeReplicaGroup
from tests.controller.rest_scaling import Serve, serving


@pytest.fixture(scope="module")
def grader_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The REAL grader (copy task, the faulty-rewards plug-in) for the module's tests."""
    port = free_port()
    config = loop_config(tmp_path_factory.mktemp("grader"), port)
    process = ServiceProcess(build_grader(config), config)
    process.start()
    yield f"127.0.0.1:{port}"
    process.shutdown("test finished")


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[FakePod]:
    """One fake pod whose checkpoints go under the test's run directory."""
    pod = FakePod(tmp_path / "run" / "checkpoints")
    yield pod
    pod.stop()


@pytest.fixture
def run_config() -> ConfigFor:
    """How ``run_loop`` builds its config; a module overrides this fixture to change it."""
    return loop_config


@pytest.fixture
def run_loop(tmp_path: Path, grader_address: str, run_config: ConfigFor) -> RunLoop:
    """``run_loop(pod, **loop)`` runs the loop to its end in the test's run directory."""

    def run(pod: FakePod, **loop: Any) -> dict[str, Any]:
        return run_fake_pod_loop(pod, tmp_path / "run", grader_address, run_config, **loop)

    return run


@pytest.fixture
def cluster(tmp_path: Path, grader_address: str) -> Iterator[Cluster]:
    """Fake pods whose trainers form one replica group; stopped at teardown."""
    cluster = Cluster(tmp_path, grader_address, FakeReplicaGroup())
    yield cluster
    cluster.stop()


@pytest.fixture
def serve() -> Iterator[Serve]:
    """Serves the real REST app on a free port (``serve(state, scaler, **app_options)``)."""
    yield from serving()
