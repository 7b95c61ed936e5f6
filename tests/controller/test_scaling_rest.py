"""One way to scale: ``PUT /v1/workers/replicas`` and ``podrl scale`` over real HTTP, locally
(the controller's LocalScaler) and in a cluster (KubernetesScaler against the emulated API
server, with the watch feeding the pod table the desired count and the terminating pods).

The app here holds the suite's run secret, as the controller does: every PUT carries an
operator token (who may scale: tests/controller/test_rest_auth.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from podrl.cli.main import main as podrl
from podrl.controller.pods.kube_watch import KubeWatch
from podrl.controller.pods.scaling import KubernetesScaler, LocalScaler
from podrl.controller.pods.table import PodTable
from podrl.controller.service.status import RunState
from podrl.v1 import controller_pb2
from tests.controller.kube_api import ApiServer
from tests.controller.kube_objects import (
    NAMESPACE,
    STATEFULSET,
    WAIT_SECONDS,
    create_pod,
    create_statefulset,
    watch_config,
)
from tests.controller.rest_scaling import MAX, Serve, operator_headers


def _register_pod(table: PodTable, pod: str) -> None:
    for component in (1, 2, 3):
        table.register(pod, component, f"10.0.0.{len(pod)}:{5000 + component}", f"{pod}-1")


def _state(table: PodTable) -> RunState:
    return RunState("scale", table, 1)


def test_put_replicas_sets_the_local_count_and_status_shows_it(serve: Serve) -> None:
    changes: list[int] = []
    scaler = LocalScaler(1, on_change=changes.append)
    table = PodTable(60)
    _register_pod(table, "local-0")
    table.follow_cluster(scaler.desired_replicas)
    url = serve(_state(table), scaler)
    reply = httpx.put(
        f"{url}/v1/workers/replicas", json={"replicas": 3}, headers=operator_headers(), timeout=5
    )
    assert reply.status_code == 202
    assert reply.json() == {"desired_replicas": 3, "max_replicas": MAX}
    assert changes == [3]
    assert httpx.get(f"{url}/v1/workers/replicas", timeout=5).json()["desired_replicas"] == 3
    table.admit()
    status = httpx.get(f"{url}/v1/status", timeout=5).json()
    assert status["desired_replicas"] == 3 and status["epoch"] == 1
    metrics = {
        sample.name: sample.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        for sample in family.samples
    }
    assert metrics["podrl_desired_replicas"] == 3
    assert metrics["podrl_pods"] == 1 and metrics["podrl_epoch"] == 1
    assert status["pods"] == [
        {"id": "local-0", "state": "training", "policy_version": 0, "share": 0,
         "train_sequences": 0}
    ]  # fmt: skip


BAD_BODIES = [
    {"replicas": 0}, {"replicas": MAX + 1}, {"replicas": True}, {"replicas": "2"},
    {"replicas": 2.5}, {}, {"pods": 2},
]  # fmt: skip


@pytest.mark.parametrize("body", BAD_BODIES)
def test_put_replicas_out_of_range_or_not_an_integer_is_a_422_naming_the_field(
    serve: Serve, body: dict[str, object]
) -> None:
    scaler = LocalScaler(1)
    url = serve(RunState("scale", PodTable(60), 1), scaler)
    reply = httpx.put(
        f"{url}/v1/workers/replicas", json=body, headers=operator_headers(), timeout=5
    )
    assert reply.status_code == 422
    locations = [tuple(error["loc"]) for error in reply.json()["detail"]]
    assert ("body", "replicas") in locations or ("body", "pods") in locations
    assert scaler.desired_replicas() == 1


def test_podrl_scale_calls_the_controller(serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    scaler = LocalScaler(1)
    url = serve(RunState("scale", PodTable(60), 1), scaler)
    assert podrl(["scale", "--replicas", "2", "--url", url]) == 0
    assert scaler.desired_replicas() == 2
    assert podrl(["scale", "--replicas", str(MAX + 1), "--url", url]) == 2
    assert f"replicas: Input should be less than or equal to {MAX}" in capsys.readouterr().err
    assert scaler.desired_replicas() == 2


def test_a_controller_without_a_scaler_says_so(serve: Serve) -> None:
    url = serve(RunState("scale", PodTable(60), 1), None)
    reply = httpx.put(
        f"{url}/v1/workers/replicas", json={"replicas": 2}, headers=operator_headers(), timeout=5
    )
    assert reply.status_code == 501


@pytest.fixture
def api_server() -> Iterator[ApiServer]:
    with ApiServer() as api:
        yield api


def test_in_a_cluster_put_replicas_scales_the_statefulset_and_the_roster_follows_the_watch(
    serve: Serve, api_server: ApiServer
) -> None:
    kube = client.ApiClient(api_server.configuration())
    create_statefulset(kube, replicas=2, ready=2)
    create_pod(kube, "podrl-worker-0")
    create_pod(kube, "podrl-worker-1", finalizers=["podrl.test/hold"])
    config = watch_config(api_server)
    watch = KubeWatch(config)
    watch.start()
    scaler = KubernetesScaler(config)
    try:
        watch.wait_for(lambda v: v.synced and len(v.pods) == 2, WAIT_SECONDS)
        table = PodTable(60)
        for pod in ("podrl-worker-0", "podrl-worker-1"):
            _register_pod(table, pod)
        table.follow_cluster(
            desired_replicas=lambda: watch.view().desired_replicas,
            terminating=lambda: watch.view().terminating,
        )
        assert [pod.id for pod in table.admit()] == ["podrl-worker-0", "podrl-worker-1"]
        url = serve(_state(table), scaler)
        reply = httpx.put(
            f"{url}/v1/workers/replicas",
            json={"replicas": 1},
            headers=operator_headers(),
            timeout=10,
        )
        assert reply.status_code == 202
        apps = client.AppsV1Api(kube)
        assert apps.read_namespaced_stateful_set(STATEFULSET, NAMESPACE).spec.replicas == 1
        watch.wait_for(lambda v: v.desired_replicas == 1, WAIT_SECONDS)
        assert httpx.get(f"{url}/v1/status", timeout=5).json()["desired_replicas"] == 1
        # The StatefulSet controller deletes the highest ordinal: the watch sees its deletion
        # timestamp before its services drain, and the next step boundary leaves it out.
        client.CoreV1Api(kube).delete_namespaced_pod("podrl-worker-1", NAMESPACE)
        watch.wait_for(lambda v: "podrl-worker-1" in v.terminating, WAIT_SECONDS)
        assert table.complete_pods().keys() == {"podrl-worker-0", "podrl-worker-1"}
        assert [pod.id for pod in table.admit()] == ["podrl-worker-0"]
        assert table.epoch == 2
        states = {p.id: p.state for p in table.status()}
        assert states == {"podrl-worker-0": "training", "podrl-worker-1": "draining"}
    finally:
        watch.stop()
        scaler.close()
        kube.close()


def test_a_drained_member_leaves_the_next_admission() -> None:
    table = PodTable(60)
    for pod in ("local-0", "local-1"):
        _register_pod(table, pod)
    assert len(table.admit()) == 2
    table.drain("local-1", controller_pb2.COMPONENT_TRAINER, "local-1-1")
    assert [pod.id for pod in table.admit()] == ["local-0"]
    assert table.epoch == 2
    assert table.admit() and table.epoch == 2  # the same set: the same epoch
