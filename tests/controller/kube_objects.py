"""The worker StatefulSet and pods in the emulated Kubernetes API, and a KubeWatch config."""

from __future__ import annotations

from typing import Any

from kubernetes import client

from podrl.controller.pods.kube_watch import KubeWatchConfig
from tests.controller.kube_api import ApiServer

NAMESPACE = "podrl"
STATEFULSET = "podrl-worker"
# What the chart's selectorLabels render to for the worker component of release "podrl".
SELECTOR = {
    "app.kubernetes.io/name": "podrl",
    "app.kubernetes.io/instance": "podrl",
    "app.kubernetes.io/component": "worker",
}
WAIT_SECONDS = 30
BACKOFF_INITIAL = 0.05


def watch_config(server: ApiServer, **overrides: Any) -> KubeWatchConfig:
    """A KubeWatchConfig for the emulated API server's worker StatefulSet; ``overrides`` win."""
    settings: dict[str, Any] = {
        "namespace": NAMESPACE,
        "statefulset": STATEFULSET,
        "selector": SELECTOR,
        "client_configuration": server.configuration(),
        "watch_timeout_seconds": 60,
        "backoff_initial_seconds": BACKOFF_INITIAL,
        "backoff_max_seconds": 2.0,
        "backoff_jitter": 0.0,
    }
    return KubeWatchConfig(**{**settings, **overrides})


def create_statefulset(
    kube: client.ApiClient, replicas: int = 1, ready: int = 0, name: str = STATEFULSET
) -> None:
    """A worker StatefulSet as the chart renders it, with this status."""
    client.AppsV1Api(kube).create_namespaced_stateful_set(
        NAMESPACE,
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": SELECTOR},
            "spec": {
                "replicas": replicas,
                "serviceName": name,
                "selector": {"matchLabels": SELECTOR},
                "template": {
                    "metadata": {"labels": SELECTOR},
                    "spec": {"containers": [{"name": "trainer", "image": "podrl-trainer"}]},
                },
            },
            "status": {"replicas": replicas, "readyReplicas": ready},
        },
    )


def create_pod(
    kube: client.ApiClient,
    name: str,
    *,
    ready: bool = True,
    labels: dict[str, str] | None = None,
    finalizers: list[str] | None = None,
    ip: str = "10.1.0.1",
) -> None:
    """A running worker pod (Ready unless ``ready`` is False)."""
    metadata: dict[str, Any] = {"name": name, "namespace": NAMESPACE}
    metadata["labels"] = SELECTOR if labels is None else labels
    if finalizers:
        metadata["finalizers"] = finalizers
    client.CoreV1Api(kube).create_namespaced_pod(
        NAMESPACE,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": {"containers": [{"name": "trainer", "image": "podrl-trainer"}]},
            "status": {
                "phase": "Running",
                "podIP": ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        },
    )
