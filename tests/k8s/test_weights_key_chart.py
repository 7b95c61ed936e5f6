"""The chart gives the pod's weights key (podrl.weights.protocol) to the trainer and the generator
only: a memory-backed emptyDir of the pod, mounted in those two containers, named by
PODRL_WEIGHTS_KEY_FILE; the grader, the init container and the controller never see it.
docker-compose the same way, in the /dev/shm only those two share."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.k8s.manifests import container, env_map, pod_specs, render, worker_pod

REPO_ROOT = Path(__file__).resolve().parents[2]
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


def test_compose_gives_the_key_to_trainer_and_generator_in_their_own_shm() -> None:
    """docker-compose: the key file lies in the /dev/shm that only a trainer and the generator
    joined to its IPC namespace share; no other service names it."""
    services = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())["services"]
    for name, service in services.items():
        key = service.get("environment", {}).get("PODRL_WEIGHTS_KEY_FILE")
        if name.startswith(("trainer", "generator")):
            assert key == "/dev/shm/podrl-weights-key", name
        else:
            assert key is None, name
        if name.startswith("generator"):
            assert service["ipc"] == f"service:{name.replace('generator', 'trainer')}"
