"""docker-compose.yaml: parses as a Compose Specification document (compose-spec, a typed
parser of the spec; `docker compose config`, or podman-compose's with docker/compose/podman.yaml,
where an engine exists), and every service, profile, volume and config it references exists and
is active in the same profiles. The CPU profile runs in containers too (marked ``containers`` and
``slow``): a short GRPO run trains and its export loads."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from compose_spec import PyCompose

from podrl.config import load_config
from podrl.tools.render_k8s import REPO_ROOT
from tests.k8s.local_pod import wait_until
from tests.k8s.podman_pod import inspect, missing_requirements, podman, podman_env

COMPOSE_FILE = REPO_ROOT / "docker-compose.yaml"
PODMAN_OVERRIDE = REPO_ROOT / "docker" / "compose" / "podman.yaml"
PROFILES = {"cpu", "gpu"}
# The profiles a run turns on together: an engine's, with or without the environment service.
RUN_TIMEOUT = 1200
COMBINATIONS = [("cpu",), ("gpu",), ("cpu", "environments"), ("gpu", "environments-gpu")]
# One-shot services that write the tiny model, not podrl services.
MODEL_SERVICES = {"model", "model-gpu"}


def _resolved() -> dict[str, Any]:
    """The file with YAML anchors and merge keys resolved and each ``${VAR:-default}`` at its
    default (as docker compose reads it where VAR is unset)."""
    return yaml.safe_load(re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", COMPOSE_FILE.read_text()))


def _active(service: dict[str, Any], profile: str) -> bool:
    return "profiles" not in service or profile in service["profiles"]


def test_compose_file_parses_as_compose_spec() -> None:
    compose = PyCompose.from_json(json.dumps(_resolved()))
    assert set(compose.service_names()) == {
        "controller", "grader", "model", "trainer", "generator", "environments",
        "model-gpu", "trainer-gpu", "generator-gpu", "environments-gpu",
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
    assert used_profiles == {p for c in COMBINATIONS for p in c}
    env_file = (REPO_ROOT / ".env").read_text()
    assert "COMPOSE_PROFILES=cpu" in env_file  # the CPU profile is the default
    for profiles in COMBINATIONS:
        active = {name for name, s in services.items() if any(_active(s, p) for p in profiles)}
        for name in active:
            for ref in _references(services[name]):
                assert ref in active, f"{name} needs {ref}, which is off in profiles {profiles}"
        # Exactly one trainer and one generator per profile; the grader and controller always.
        assert {"controller", "grader"} <= active
        assert len([n for n in active if n.startswith("trainer")]) == 1
        assert len([n for n in active if n.startswith("generator")]) == 1
        assert len([n for n in active if n.startswith("environments")]) == (len(profiles) == 2)
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


def test_trainer_and_generator_start_once_the_model_is_written() -> None:
    """The generator mounts run-state read-only: it must not race a writer of the tiny model
    there, or it stops with 'generator.model_path: ... cannot be written'. The model service
    writes it (once) at the path both load; nothing waits for a health check, which podman
    before 4.6 cannot wait for (the workers retry their registration instead)."""
    doc = _resolved()
    services = doc["services"]
    config = load_config(REPO_ROOT / doc["configs"]["run-config"]["file"], {})
    tiny = str(config.generator.resolved_model_path(config.run_dir))
    for suffix in ("", "-gpu"):
        model, trainer, generator = (f"{n}{suffix}" for n in ("model", "trainer", "generator"))
        assert services[model]["command"] == [tiny]
        assert "make-tiny-model" in services[model]["entrypoint"][-1]
        assert services[model]["image"] == services[trainer]["image"]
        for name in (trainer, generator):
            done = {"condition": "service_completed_successfully"}
            assert services[name]["depends_on"][model] == done, name
        assert "run-state:/var/lib/podrl:ro" in services[generator]["volumes"]
        assert "run-state:/var/lib/podrl" in services[model]["volumes"]
    for name, service in services.items():
        needs = service.get("depends_on") or {}
        conditions = needs.values() if isinstance(needs, dict) else []
        assert {"condition": "service_healthy"} not in conditions, name


def test_trainer_and_generator_keep_their_compile_caches_on_a_volume() -> None:
    """The compile caches (PODRL_COMPILE_CACHE_DIR) live on a named volume that outlives the
    containers; the images own its mount point, so a fresh volume is writable by the user."""
    resolved = _resolved()
    assert "compile-cache" in resolved["volumes"]
    for name in ("trainer", "generator", "trainer-gpu", "generator-gpu"):
        service = resolved["services"][name]
        assert "compile-cache:/var/cache/podrl" in service["volumes"], name
        assert service["environment"]["PODRL_COMPILE_CACHE_DIR"] == "/var/cache/podrl", name
    for image in ("trainer", "generator"):
        dockerfile = (REPO_ROOT / "docker" / image / "Dockerfile").read_text()
        assert "install -d -o 10001 -g 10001 /var/lib/podrl /var/cache/podrl" in dockerfile


def test_containers_are_hardened_and_never_privileged() -> None:
    for name, service in _resolved()["services"].items():
        assert service["user"] == "10001:10001", name
        assert service["read_only"] is True, name
        assert service["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in service["security_opt"], name
        for key in ("privileged", "cap_add"):
            assert key not in service, (name, key)
        # Only the environment service joins another's network namespace: the generator's.
        assert service.get("network_mode") in (None, f"service:generator{name[12:]}"), name
        assert service.get("pid") in (None, "service:trainer", "service:trainer-gpu"), name


def test_each_service_loads_the_run_config_with_its_environment() -> None:
    doc = _resolved()
    config_file = REPO_ROOT / doc["configs"]["run-config"]["file"]
    grpc_names = {"environments": "Environment"}
    for name, service in doc["services"].items():
        if name in MODEL_SERVICES:
            continue
        env = {k: str(v) for k, v in service["environment"].items()}
        config = load_config(config_file, env)
        kind = name.removesuffix("-gpu")
        section = getattr(config, kind)
        assert section.bind_host == "0.0.0.0", name
        assert config.controller.advertise_host == "controller", name
        if name != "controller":
            # Reachable by its service name; the environment service in the generator's
            # network namespace, where the controller looks for it.
            host = name.replace("environments", "generator")
            assert section.advertise_host == host, name
            assert config.worker_id == "compose-worker-0", name
        if name.endswith("-gpu") and kind != "environments":  # it runs no model
            assert config.device == "cuda"
        probe = service["healthcheck"]["test"]
        assert probe[:4] == ["CMD", "python", "-m", "podrl.tools.check_health"]
        grpc_name = grpc_names.get(kind, kind.title())
        assert probe[4] == f"127.0.0.1:{section.grpc_port}=podrl.v1.{grpc_name}"


def _has_docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = ["docker", "compose", "version"]
    return subprocess.run(probe, capture_output=True, check=False).returncode == 0


def _compose() -> list[str] | None:
    """The compose command for docker-compose.yaml here: ``docker compose`` where docker has
    the plugin, else podman-compose (dev requirements) with docker/compose/podman.yaml where
    podman is installed; None with neither."""
    if _has_docker_compose():
        return ["docker", "compose", "-f", str(COMPOSE_FILE)]
    if shutil.which("podman") is None or importlib.util.find_spec("podman_compose") is None:
        return None
    podman_compose = [sys.executable, "-m", "podman_compose"]
    return [*podman_compose, "-f", str(COMPOSE_FILE), "-f", str(PODMAN_OVERRIDE)]


def _compose_env(**extra: str) -> dict[str, str]:
    # Compose refuses to interpolate the file without the run secret (docs/security.md).
    return {**podman_env(), "PODRL_RUN_SECRET": "0" * 64, **extra}


@pytest.mark.skipif(_compose() is None, reason="neither `docker compose` nor podman here")
def test_compose_config_accepts_the_file() -> None:
    command = _compose()
    assert command is not None
    profiles = sorted({p for c in COMBINATIONS for p in c})  # one call: podman-compose is slow
    done = subprocess.run(
        [*command, *(f"--profile={p}" for p in profiles), "config"],
        env=_compose_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert set(yaml.safe_load(done.stdout)["services"]) == set(_resolved()["services"])


def test_the_podman_override_shares_shm_and_pids_between_trainer_and_generator_only() -> None:
    """podman-compose drops `ipc` and cannot pass `pid: service:trainer`: the override gives
    the trainer and the generator (only) one tmpfs at /dev/shm and the trainer's PID
    namespace, and mounts the run config that podman-compose's missing `configs` would."""
    override = yaml.load(PODMAN_OVERRIDE.read_text(), Loader=_ResetLoader)
    services = override["services"]
    shm = {n for n, s in services.items() if "worker-shm:/dev/shm" in s.get("volumes", [])}
    assert shm == {"trainer", "generator"}
    assert services["generator"]["pid"] == f"container:{services['trainer']['container_name']}"
    first, *_ = [n for n, s in services.items() if any(
        v.startswith("worker-shm:") for v in s.get("volumes", []))]  # fmt: skip
    assert first == "model"  # mounted first where its image has no folder (the file says why)
    assert override["volumes"]["worker-shm"]["driver_opts"]["o"].startswith("mode=1777")
    run_config = "./docker/compose/run.yaml:/etc/podrl/run.yaml:ro"
    for name in ("controller", "grader", "trainer", "generator", "environments"):
        assert run_config in services[name]["volumes"], name


class _ResetLoader(yaml.SafeLoader):
    """Reads compose's ``!reset`` tag (an override that removes a key) as None."""


_ResetLoader.add_constructor("!reset", lambda loader, node: None)


def _container(service: str) -> str:
    done = podman(
        "ps", "--filter", "label=com.docker.compose.project=podrl",
        "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.Names}}",
    )  # fmt: skip
    (name,) = done.stdout.split()
    return name


@contextlib.contextmanager
def _compose_up(profiles: str, *extra_files: Path) -> Iterator[Callable[[str], Any]]:
    """``up -d`` of ``profiles`` with podman-compose from the built images, ``extra_files`` as
    further ``-f`` overrides: once the run has finished, yields a GET of the controller's REST
    API from the host (path -> JSON); ``down --volumes`` at the end. Skips without
    podman-compose or an image."""
    command = _compose()
    if command is None or command[0] == "docker":
        pytest.skip("runs with podman-compose (podman and the dev requirements)")
    services = _resolved()["services"]
    images = sorted(
        {services[n]["image"] for n in ("controller", "grader", "trainer", "generator")}
    )
    missing = missing_requirements(images)
    if missing:
        pytest.skip(missing)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = _compose_env(
        PODRL_RUN_SECRET=secrets.token_hex(32), PODRL_HTTP_PORT=str(port), COMPOSE_PROFILES=profiles
    )
    command = [*command, *(arg for f in extra_files for arg in ("-f", str(f)))]

    def compose(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*command, *args], env=env, capture_output=True, text=True, timeout=600, check=False
        )

    def rest(path: str) -> Any:
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5).json()

    def status() -> dict[str, Any]:
        try:
            return rest("/v1/status")
        except httpx.HTTPError:
            return {"phase": "starting"}

    def finished() -> bool:
        now = status()
        assert now["phase"] != "failed", now.get("error")
        return now["phase"] == "finished"

    compose("down", "--volumes", "-t", "10")  # a run of this project left behind
    try:
        done = compose("up", "-d")
        assert done.returncode == 0, done.stderr[-3000:]
        wait_until(finished, RUN_TIMEOUT, lambda: None, "the compose run")
        yield rest
    finally:
        compose("down", "--volumes", "-t", "30")


@pytest.mark.containers
@pytest.mark.slow
def test_the_cpu_profile_trains_a_short_run_in_containers(tmp_path) -> None:
    """podman-compose with docker/compose/podman.yaml runs the CPU profile from the built
    images (make images VARIANT=cpu): the run of docker/compose/run.yaml finishes, its export
    loads, and only the trainer and the generator share /dev/shm and a PID namespace."""
    config = load_config(REPO_ROOT / _resolved()["configs"]["run-config"]["file"], {})
    with _compose_up("cpu") as rest:
        now = rest("/v1/status")
        assert now["step"] == config.loop.steps and now["policy_version"] > 0, now
        assert now["healthy_pods"] == ["compose-worker-0"], now
        trainer = _container("trainer")
        export = f"{config.run_dir}/export"
        podman("cp", f"{trainer}:{export}", str(tmp_path / "export"))
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tmp_path / "export")
        assert sum(p.numel() for p in model.parameters()) > 0
        key = "/dev/shm/podrl-weights-key"
        generator, grader = _container("generator"), _container("grader")
        assert podman("exec", generator, "test", "-s", key, check=False).returncode == 0
        assert podman("exec", grader, "test", "-e", key, check=False).returncode != 0
        # The generator sees the trainer's service process; the grader does not.
        seen = podman("exec", generator, "cat", "/proc/1/cmdline").stdout
        assert "podrl-trainer" in seen, seen
        assert "podrl-trainer" not in podman("exec", grader, "cat", "/proc/1/cmdline").stdout


@pytest.mark.containers
@pytest.mark.slow
def test_the_environments_profile_plays_episodes_in_containers() -> None:
    """Profile ``environments`` with a run config whose task names the built-in calculator:
    the environment service runs in the generator's network namespace, where the controller
    finds it, and every step plays its episodes (two prompts x four samples)."""
    run_config = yaml.safe_load((REPO_ROOT / "docker" / "compose" / "run.yaml").read_text())
    run_config["loop"]["steps"] = 2
    run_config["tasks"] = {
        "definitions": [
            {
                "name": "calc",
                "source": {"kind": "procedural", "generator": "add"},
                "rewards": [{"name": "exact_match"}],
                "environment": "calculator",
            }
        ]
    }
    # Readable by the containers' user (pytest's tmp_path is root's alone).
    folder = Path(tempfile.mkdtemp(prefix="podrl-compose-"))
    folder.chmod(0o755)
    try:
        (folder / "run.yaml").write_text(yaml.safe_dump(run_config))
        (folder / "run.yaml").chmod(0o644)
        mount = f"{folder / 'run.yaml'}:/etc/podrl/run.yaml:ro"
        names = ("controller", "grader", "trainer", "generator", "environments")
        override = {"services": {n: {"volumes": [mount]} for n in names}}
        (folder / "config.yaml").write_text(yaml.safe_dump(override))
        with _compose_up("cpu,environments", folder / "config.yaml") as rest:
            assert rest("/v1/status")["step"] == 2
            steps = rest("/v1/steps")
            environments = inspect(_container("environments"))
        assert [s["step"] for s in steps] == [1, 2]
        for record in steps:
            assert record["metrics"]["episodes"] == 8, record
        assert environments["HostConfig"]["NetworkMode"].startswith("container:")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
