"""The chart gives the pod's weights key (podrl.weights.keys) to the trainer and the generator
only: a memory-backed emptyDir of the pod, mounted in those two containers, named by
PODRL_WEIGHTS_KEY_FILE; the grader, the init container and the controller never see it."""

from __future__ import annotations

import pytest

from tests.k8s.manifests import container, env_map, pod_specs, render, worker_pod

KEY_DIR = "/var/run/podrl/weights-key"
FIELDS = {"metadata.name": "p-0", "metadata.namespace": "podrl", "status.podIP": "10.0.0.9"}


@pytest.mark.parametrize(
    "values",
    [
        {},
        {
            "gpu": {"mode": "devicePlugin"},
            "model": {"source": "download", "download": {"repo": "Qwen/Qwen3-0.6B"}},
        },
    ],
)
def test_only_trainer_and_generator_get_the_weights_key(values: dict) -> None:
    objects = render(values)
    pod = worker_pod(objects)
    (volume,) = [v for v in pod["volumes"] if v["name"] == "weights-key"]
    assert volume["emptyDir"]["medium"] == "Memory"  # never written to a node's disk
    for name in ("trainer", "generator"):
        c = container(pod, name)
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "weights-key"]
        assert mount == {"name": "weights-key", "mountPath": KEY_DIR}  # the trainer writes it
        assert env_map(c, FIELDS)["PODRL_WEIGHTS_KEY_FILE"] == f"{KEY_DIR}/key"
    for pod_name, spec in pod_specs(objects):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if c["name"] in ("trainer", "generator") and spec is pod:
                continue
            assert "weights-key" not in {m["name"] for m in c.get("volumeMounts", [])}, (
                pod_name,
                c["name"],
            )
            assert "PODRL_WEIGHTS_KEY_FILE" not in {e["name"] for e in c.get("env", [])}
