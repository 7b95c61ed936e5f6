"""docker-compose.yaml: parses as a Compose Specification document (compose-spec, a typed
parser of the spec; `docker compose config` where an engine exists), and every service,
profile, volume and config it references exists and is active in the same profiles."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any

import pytest
import yaml
from compose_spec import PyCompose

from podrl.config import load_config
from podrl.tools.render_k8s import REPO_ROOT

COMPOSE_FILE = REPO_ROOT / "docker-compose.yaml"
PROFILES = {"cpu", "gpu"}


def _resolved() -> dict[str, Any]:
    """The file with YAML anchors and merge keys resolved (as docker compose reads it)."""
    return yaml.safe_load(COMPOSE_FILE.read_text())


def _active(service: dict[str, Any], profile: str) -> bool:
    return "profiles" not in service or profile in service["profiles"]


def test_compose_file_parses_as_compose_spec() -> None:
    compose = PyCompose.from_json(json.dumps(_resolved()))
    assert set(compose.service_names()) == {
        "controller", "grader", "trainer", "generator", "trainer-gpu", "generator-gpu",
    }  # fmt: skip
    compose.to_spec()  # the spec's pydantic model accepts it too


def test_compose_spec_parser_rejects_unknown_fields() -> None:
    broken = _resolved()
    broken["services"]["trainer"]["shm_sise"] = "2gb"
    with pytest.raises(ValueError, match="shm_sise"):
        PyCompose.from_json(json.dumps(broken))


def _references(service: dict[str, Any]) -> list[str]:
    refs = list(service.get("depends_on") or [])
    for key in ("ipc", "pid", "network_mode"):
        value = service.get(key) or ""
        if value.startswith("service:"):
            refs.append(value.removeprefix("service:"))
    return refs


def test_references_exist_and_share_profiles() -> None:
    doc = _resolved()
    services = doc["services"]
    used_profiles = {p for s in services.values() for p in s.get("profiles", [])}
    assert used_profiles == PROFILES
    env_file = (REPO_ROOT / ".env").read_text()
    assert "COMPOSE_PROFILES=cpu" in env_file  # the CPU profile is the default
    for profile in PROFILES:
        active = {name for name, s in services.items() if _active(s, profile)}
        for name in active:
            for ref in _references(services[name]):
                assert ref in active, f"{name} needs {ref}, which is off in profile {profile}"
        # Exactly one trainer and one generator per profile; the grader and controller always.
        assert {"controller", "grader"} <= active
        assert len([n for n in active if n.startswith("trainer")]) == 1
        assert len([n for n in active if n.startswith("generator")]) == 1
    for name, service in services.items():
        for mount in service.get("volumes") or []:
            source = mount.split(":")[0] if isinstance(mount, str) else mount["source"]
            if not source.startswith((".", "/")):
                assert source in doc["volumes"], f"{name} mounts undeclared volume {source}"
        for config in service.get("configs") or []:
            source = config if isinstance(config, str) else config["source"]
            assert source in doc["configs"], f"{name} uses undeclared config {source}"
            assert (REPO_ROOT / doc["configs"][source]["file"]).is_file()
        build = service.get("build")
        if build:
            assert (REPO_ROOT / build["context"] / build["dockerfile"]).is_file()


def test_gpu_profile_shares_gpus_shm_and_pid_namespace() -> None:
    services = _resolved()["services"]
    trainer, generator = services["trainer-gpu"], services["generator-gpu"]
    for service in (trainer, generator):
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["count"] == "all"
    assert trainer["ipc"] == "shareable"
    assert generator["ipc"] == "service:trainer-gpu"
    assert generator["pid"] == "service:trainer-gpu"
    # CPU profile: the weight handles are POSIX shared memory, so /dev/shm is shared too.
    assert services["generator"]["ipc"] == "service:trainer"


def test_the_generator_starts_once_the_trainer_wrote_the_model() -> None:
    """The generator mounts run-state read-only: it must not race the trainer, which writes
    the tiny model there, or it stops with 'generator.model_path: ... cannot be written'."""
    services = _resolved()["services"]
    for generator, trainer in (("generator", "trainer"), ("generator-gpu", "trainer-gpu")):
        assert services[generator]["depends_on"][trainer] == {"condition": "service_healthy"}
        assert "run-state:/var/lib/podrl:ro" in services[generator]["volumes"]
        assert "run-state:/var/lib/podrl" in services[trainer]["volumes"]


def test_containers_are_hardened_and_never_privileged() -> None:
    for name, service in _resolved()["services"].items():
        assert service["user"] == "10001:10001", name
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        for key in ("privileged", "cap_add", "network_mode"):
            assert key not in service, (name, key)
        assert service.get("pid") in (None, "service:trainer", "service:trainer-gpu"), name


def test_each_service_loads_the_run_config_with_its_environment() -> None:
    doc = _resolved()
    config_file = REPO_ROOT / doc["configs"]["run-config"]["file"]
    for name, service in doc["services"].items():
        env = {k: str(v) for k, v in service["environment"].items()}
        config = load_config(config_file, env)
        section = getattr(config, name.removesuffix("-gpu"))
        assert section.bind_host == "0.0.0.0", name
        assert config.controller.advertise_host == "controller", name
        if name != "controller":
            assert section.advertise_host == name, name  # reachable by its service name
            assert config.worker_id == "compose-worker-0", name
        if name.endswith("-gpu"):
            assert config.device == "cuda"
        probe = service["healthcheck"]["test"]
        assert probe[:4] == ["CMD", "python", "-m", "podrl.tools.check_health"]
        assert probe[4] == f"127.0.0.1:{section.grpc_port}=podrl.v1.{name.split('-')[0].title()}"


def _has_docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = ["docker", "compose", "version"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _has_docker_compose(), reason="no `docker compose` on this machine")
def test_docker_compose_config_accepts_the_file() -> None:
    for profile in sorted(PROFILES):
        done = subprocess.run(
            ["docker", "compose", "-f", str(COMPOSE_FILE), "--profile", profile, "config", "-q"],
            # Compose refuses to interpolate the file without the run secret (docs/security.md).
            env={**os.environ, "PODRL_RUN_SECRET": "0" * 64},
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
