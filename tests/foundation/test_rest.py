"""The controller's REST API: probes, status, workers, Prometheus metrics, OpenAPI."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from podrl.cli.local_cluster import LocalCluster
from podrl.controller.pods.table import PodTable
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RunState
from podrl.v1 import controller_pb2


def test_metrics_parse_as_prometheus_text(cluster: LocalCluster) -> None:
    reply = httpx.get(f"{cluster.rest_url}/metrics", timeout=5)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(reply.text)}
    # The controller has handled Register/Heartbeat RPCs by now, and counted them.
    handled = families["podrl_grpc_server_handled"]
    methods = {s.labels["grpc_method"] for s in handled.samples}
    assert {"Register", "Heartbeat"} <= methods


def test_worker_metrics_endpoints_parse(cluster: LocalCluster) -> None:
    for name, url in cluster.urls().items():
        if name.endswith("metrics"):
            families = list(text_string_to_metric_families(httpx.get(url, timeout=5).text))
            assert any(f.name == "podrl_service_serving" for f in families), name


def test_docs_and_openapi_are_served(cluster: LocalCluster) -> None:
    docs = httpx.get(f"{cluster.rest_url}/docs", timeout=5)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    spec = httpx.get(f"{cluster.rest_url}/openapi.json", timeout=5).json()
    for path in ("/healthz", "/readyz", "/v1/status", "/v1/workers", "/metrics"):
        assert path in spec["paths"], path


def test_status_and_workers(cluster: LocalCluster) -> None:
    status = httpx.get(f"{cluster.rest_url}/v1/status", timeout=5).json()
    assert status["ready"] is True
    assert status["healthy_pods"] == ["local-0"]
    workers = httpx.get(f"{cluster.rest_url}/v1/workers", timeout=5).json()
    assert sorted(w["component"] for w in workers) == ["generator", "grader", "trainer"]
    assert all(w["healthy"] and w["state"] == "serving" for w in workers)
    assert httpx.get(f"{cluster.rest_url}/healthz", timeout=5).status_code == 200
    assert httpx.get(f"{cluster.rest_url}/readyz", timeout=5).status_code == 200


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_readyz_follows_worker_health() -> None:
    """Not ready without a complete pod; ready with one; not ready once a member goes silent
    or drains."""
    from fastapi.testclient import TestClient

    clock = _Clock()
    registry = PodTable(heartbeat_timeout_seconds=10, clock=clock)
    client = TestClient(build_rest_app(RunState("t", registry, min_worker_pods=1)))
    assert client.get("/readyz").status_code == 503
    for component in (1, 2, 3):
        registry.register("pod-0", component, f"h:{component}", incarnation="a")
    assert client.get("/readyz").status_code == 200
    clock.now += 11  # no heartbeat for longer than the timeout
    assert client.get("/readyz").status_code == 503
    for component in (1, 2, 3):
        assert registry.heartbeat("pod-0", component, "a", controller_pb2.WORKER_STATE_SERVING, 0)
    assert client.get("/readyz").status_code == 200
    registry.drain("pod-0", controller_pb2.COMPONENT_GENERATOR, "a")
    reply = client.get("/readyz")
    assert reply.status_code == 503 and reply.json()["healthy_pods"] == []
    # A heartbeat from another incarnation (the process restarted) is refused: re-register.
    assert not registry.heartbeat("pod-0", 2, "b", controller_pb2.WORKER_STATE_SERVING, 0)
