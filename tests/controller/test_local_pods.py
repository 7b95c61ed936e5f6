"""The local launcher keeps its pods at the controller's desired count, as the StatefulSet
controller does: new ordinals start, the highest ones drain by SIGTERM, a pod's dead process
starts again (a config error does not).

The pods' processes here are small real processes that behave as the services do on signals
(SIGTERM: exit 0 after a moment; the real services take a minute to start on 2 cores); the
desired count comes from the real controller REST app over HTTP.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from podrl.cli.local_cluster import ChildExitedError
from podrl.config import RunConfig
from podrl.controller.pods.scaling import LocalScaler
from podrl.controller.pods.table import PodTable
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RunState
from tests.controller.stand_in_cluster import StandInCluster


@pytest.fixture
def controller_scaler(tmp_path: Path) -> Iterator[tuple[StandInCluster, LocalScaler]]:
    config = RunConfig.model_validate(
        {"run_dir": str(tmp_path), "controller": {"max_worker_pods": 4}, "auth": {"disabled": True}}
    )
    cluster = StandInCluster(config, None, pods=1, on_event=lambda message: None)
    cluster.exit_codes = {}
    controller_scaler = LocalScaler(1)
    app = build_rest_app(
        RunState("t", PodTable(60), 1), None, controller_scaler, 4, auth_disabled=True
    )
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=cluster.controller_ports["http"], log_config=None
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    for ordinal in range(cluster.desired_replicas()):
        cluster._start_pod(ordinal)
    yield cluster, controller_scaler
    for pod in cluster.pods.values():
        for child in pod.children.values():
            if child.process.poll() is None:
                child.process.kill()
            child.process.wait()
    server.should_exit = True
    thread.join(timeout=10)


def _until(cluster: StandInCluster, condition: object, what: str) -> None:
    deadline = time.monotonic() + 20
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {cluster.running()}")
        cluster.supervise()
        time.sleep(0.05)


def test_the_launcher_follows_the_desired_count_up_and_down(
    controller_scaler: tuple[StandInCluster, LocalScaler],
) -> None:
    cluster, scaler = controller_scaler
    everything = ["generator", "grader", "trainer"]
    assert cluster.running() == {"local-0": everything}
    httpx.put(f"{cluster.rest_url}/v1/workers/replicas", json={"replicas": 3}, timeout=5)
    _until(cluster, lambda: len(cluster.pods) == 3, "3 pods")
    assert cluster.running() == {f"local-{i}": everything for i in range(3)}
    ports = dict(cluster._pod_ports)
    _until(cluster, cluster.all_ready, "every service to be started")
    scaler.set_replicas(1)
    highest = [cluster.pods[2], cluster.pods[1]]
    cluster.supervise()
    # Drained with SIGTERM: they exit 0 by themselves (not killed), highest ordinals first.
    assert all(pod.draining for pod in highest) and not cluster.pods[0].draining
    _until(cluster, lambda: len(cluster.pods) == 1, "the drained pods to stop")
    for pod in highest:
        assert {c.process.returncode for c in pod.children.values()} == {0}
    # Scaled up again: the ordinals come back on their ports (a StatefulSet pod's identity).
    scaler.set_replicas(2)
    _until(cluster, lambda: len(cluster.pods) == 2, "local-1 back")
    assert cluster._pod_ports[1] == ports[1]


def test_a_pods_dead_process_is_started_again_and_a_config_error_is_not(
    controller_scaler: tuple[StandInCluster, LocalScaler],
) -> None:
    cluster, scaler = controller_scaler
    trainer = cluster.child("trainer")
    trainer.process.send_signal(signal.SIGKILL)
    trainer.process.wait()
    cluster.supervise()
    again = cluster.child("trainer")
    assert again is not trainer and again.restarts == 1 and again.process.poll() is None
    cluster.exit_codes = {"grader@local-1": 2}
    scaler.set_replicas(2)
    with pytest.raises(ChildExitedError, match=r"grader@local-1 .* exited with code 2"):
        _until(cluster, lambda: False, "a config error to stop the launcher")
