"""The rendered chart's pods in real containers: the CPU variant (model source ``tiny``)
rendered by the real helm, the controller Deployment's pod (controller and Lighthouse) and one
worker pod of the StatefulSet (its ``model`` init container first) played with
``podman kube play`` from the built images (``make images VARIANT=cpu``), on a test network
where the controller Service's name resolves to the controller pod (tests/k8s/podman_pod.py says
what is done for the kubelet and the API server). A short GRPO run trains inside them.

Skipped, saying why, without podman or the images. Marked ``containers`` (``make
test-containers``) and ``slow``: `make test` does not run it.
"""

from __future__ import annotations

import base64
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from podrl.tools.render_k8s import RUN_SECRET, VARIANTS
from tests.k8s.local_pod import wait_until
from tests.k8s.manifests import NAMESPACE, RELEASE, find, render
from tests.k8s.podman_pod import (
    create_volume,
    inspect,
    logs,
    missing_requirements,
    play,
    pod_manifest,
    podman,
    stop_pod,
)

pytestmark = [pytest.mark.containers, pytest.mark.slow]

STEPS = 20
CPU_VARIANT = next(v for v in VARIANTS if v.filename == "podrl-cpu.yaml")
VALUES = {
    **CPU_VARIANT.chart_values,
    # Run state in emptyDirs: podman has no storage class; the export is copied out below.
    "persistence": {"enabled": False},
    "runConfig": {
        **CPU_VARIANT.chart_values["runConfig"],
        "loop": {
            "steps": STEPS,
            "prompts_per_step": 2,
            "sampling": {"n": 4, "max_tokens": 6},
        },
    },
}
CONTROLLER_POD = f"{RELEASE}-controller-6d5f8b7c9d-x4k2p"  # a Deployment pod's name
WORKER_POD = f"{RELEASE}-worker-0"
CONTROLLER_SERVICE = f"{RELEASE}-controller"
READY_TIMEOUT = 600
RUN_TIMEOUT = 1200
# The trainer's export folder: run_dir (values.yaml) / export (loop.export_at_end).
EXPORTS = "/var/lib/podrl/runs/podrl/export"


def _images(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(
        {
            c["image"]
            for kind in ("Deployment", "StatefulSet")
            for c in (
                find(objects, kind)["spec"]["template"]["spec"].get("initContainers", [])
                + find(objects, kind)["spec"]["template"]["spec"]["containers"]
            )
        }
    )


@dataclass
class Release:
    objects: list[dict[str, Any]]
    controller_ip: str
    worker_ip: str
    run_secret: bytes

    def status(self) -> dict[str, Any]:
        reply = httpx.get(f"http://{self.controller_ip}:8080/v1/status", timeout=5)
        reply.raise_for_status()
        return reply.json()

    def containers(self) -> dict[str, list[dict[str, Any]]]:
        """Pod name -> its main containers' rendered specs."""
        return {
            CONTROLLER_POD: find(self.objects, "Deployment")["spec"]["template"]["spec"][
                "containers"
            ],
            WORKER_POD: find(self.objects, "StatefulSet")["spec"]["template"]["spec"]["containers"],
        }

    def ip(self, pod: str) -> str:
        return self.controller_ip if pod == CONTROLLER_POD else self.worker_ip


def _probe(ip: str, probe: dict[str, Any]) -> bool:
    """The kubelet's gRPC probe, from the host to the pod IP (podman 4.3 runs no grpc probes)."""
    grpc = probe["grpc"]
    target = f"{ip}:{grpc['port']}={grpc.get('service', '')}"
    done = subprocess.run(
        [sys.executable, "-m", "podrl.tools.check_health", target],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return done.returncode == 0


def _running(pod: str, names: list[str]) -> None:
    for name in names:
        state = inspect(f"{pod}-{name}")["State"]
        if state["Status"] != "running":
            raise AssertionError(f"{pod}-{name} is {state['Status']}:\n{logs(f'{pod}-{name}')}")


def _cleanup(network: str, volumes: list[str]) -> None:
    for pod in (WORKER_POD, CONTROLLER_POD):
        podman("pod", "rm", "-f", "-t", "5", pod, check=False)
    for volume in volumes:
        podman("volume", "rm", "-f", volume, check=False)
    podman("network", "rm", "-f", network, check=False)


@pytest.fixture(scope="module")
def release() -> Iterator[Release]:
    value = secrets.token_hex(32).encode()
    created = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": RUN_SECRET, "namespace": NAMESPACE},
        "data": {"run-secret": base64.b64encode(value).decode()},
    }
    objects = [*render(VALUES, skip_tests=True), created]
    missing = missing_requirements(_images(objects))
    if missing:
        pytest.skip(missing)
    tag = secrets.token_hex(3)
    subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
    network = f"podrl-test-{tag}"
    controller_ip, worker_ip = f"{subnet}.10", f"{subnet}.20"
    service = f"{CONTROLLER_SERVICE}.{NAMESPACE}.svc"
    hosts = {
        name: controller_ip
        for name in (CONTROLLER_SERVICE, f"{CONTROLLER_SERVICE}.{NAMESPACE}", service)
    }
    volumes: list[str] = []
    _cleanup(network, volumes)
    folder = Path(tempfile.mkdtemp(prefix="podrl-pods-"))
    folder.chmod(0o755)
    try:
        podman("network", "create", "--subnet", f"{subnet}.0/24", network)
        pods = {}
        for name, kind, ip in (
            (CONTROLLER_POD, "Deployment", controller_ip),
            (WORKER_POD, "StatefulSet", worker_ip),
        ):
            spec = find(objects, kind)["spec"]["template"]["spec"]
            pods[name] = pod_manifest(
                name,
                spec,
                objects,
                namespace=NAMESPACE,
                pod_ip=ip,
                hosts=hosts,
                folder=folder / name,
                volume_prefix=f"podrl-test-{tag}",
            )
            image = spec["containers"][0]["image"]
            for volume, memory in pods[name][1].items():
                create_volume(volume, memory, image)
                volumes.append(volume)
            play(pods[name][0], folder / f"{name}.yaml", network, ip)
        release = Release(objects, controller_ip, worker_ip, value)

        def serving() -> bool:
            return all(
                _probe(release.ip(pod), c["readinessProbe"])
                for pod, containers in release.containers().items()
                for c in containers
            )

        def alive() -> None:
            for pod, containers in release.containers().items():
                _running(pod, [c["name"] for c in containers])

        wait_until(serving, READY_TIMEOUT, alive, "every container of the played pods")
        yield release
    finally:
        _cleanup(network, volumes)
        subprocess.run(["rm", "-rf", str(folder)], check=False)


def test_every_container_is_serving_on_its_probes(release: Release) -> None:
    init = inspect(f"{WORKER_POD}-model")["State"]
    assert (init["Status"], init["ExitCode"]) == ("exited", 0), logs(f"{WORKER_POD}-model")
    for pod, containers in release.containers().items():
        for c in containers:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                probe = c[kind]
                if "grpc" in probe:
                    assert _probe(release.ip(pod), probe), (pod, c["name"], kind)
                else:  # the controller's liveness: GET /healthz on its named port
                    get = probe["httpGet"]
                    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
                    port = ports.get(get["port"], get["port"])
                    url = f"http://{release.ip(pod)}:{port}{get['path']}"
                    assert httpx.get(url, timeout=5).status_code == 200, (pod, c["name"], kind)


def test_containers_run_non_root_read_only_without_capabilities(release: Release) -> None:
    for pod, containers in release.containers().items():
        for c in containers:
            name = f"{pod}-{c['name']}"
            config = inspect(name)
            assert config["HostConfig"]["ReadonlyRootfs"] is True, name
            assert config["EffectiveCaps"] in (None, []), name
            done = podman(
                "exec", name, "python", "-c",
                "import os; print(os.getuid(), os.getgid());"
                "open('/proc/self/status').read();"
                "print([l for l in open('/proc/self/status') if l.startswith('CapEff')][0]);"
                "open('/opt/podrl/x', 'w')",
                check=False,
            )  # fmt: skip
            assert done.stdout.split()[:2] == ["10001", "10001"], (name, done.stdout)
            assert "0000000000000000" in done.stdout, (name, done.stdout)
            assert "Read-only file system" in done.stderr, (name, done.stderr)


def test_trainer_and_generator_share_the_pods_memory_volume(release: Release) -> None:
    mounts = {}
    for name in ("trainer", "generator"):
        config = inspect(f"{WORKER_POD}-{name}")
        (shm,) = [m for m in config["Mounts"] if m["Destination"] == "/dev/shm"]
        mounts[name] = shm["Name"]
        done = podman("exec", f"{WORKER_POD}-{name}", "stat", "-f", "-c", "%T", "/dev/shm")
        assert done.stdout.strip() == "tmpfs", name
    assert mounts["trainer"] == mounts["generator"]
    probe = f"/dev/shm/podrl-test-{secrets.token_hex(4)}"
    podman("exec", f"{WORKER_POD}-trainer", "python", "-c", f"open('{probe}', 'w').write('x')")
    seen = podman("exec", f"{WORKER_POD}-generator", "cat", probe)
    assert seen.stdout == "x"
    podman("exec", f"{WORKER_POD}-trainer", "rm", probe)


def test_a_short_grpo_run_finishes_and_its_export_loads(release: Release, tmp_path) -> None:
    def finished() -> bool:
        status = release.status()
        assert status["phase"] != "failed", status["error"]
        return status["phase"] == "finished"

    def alive() -> None:
        for pod, containers in release.containers().items():
            _running(pod, [c["name"] for c in containers])

    wait_until(finished, RUN_TIMEOUT, alive, f"the {STEPS}-step run")
    status = release.status()
    assert status["step"] == STEPS and status["policy_version"] > 0, status
    assert status["healthy_pods"] == [WORKER_POD]
    podman("cp", f"{WORKER_POD}-trainer:{EXPORTS}", str(tmp_path / "exports"))
    (config,) = (tmp_path / "exports").rglob("config.json")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config.parent)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_sigterm_drains_every_container_and_exits_cleanly(release: Release) -> None:
    """SIGTERM to every container (then SIGKILL after the pod's grace period, as the kubelet
    does): every container must exit 0 well within it. The worker pod first, as a scale-down
    stops it: its services tell the running controller that they drain."""
    unclean: dict[str, tuple[int, str]] = {}
    for pod, containers in reversed(release.containers().items()):
        spec_kind = "StatefulSet" if pod == WORKER_POD else "Deployment"
        grace = find(release.objects, spec_kind)["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"
        ]
        started = time.monotonic()
        stop_pod(pod, [f"{pod}-{c['name']}" for c in containers], grace)
        assert time.monotonic() - started < grace, pod
        for c in containers:
            name = f"{pod}-{c['name']}"
            code = inspect(name)["State"]["ExitCode"]
            # torchft's client logs every failed heartbeat: its lines would hide the service's.
            own = [line for line in logs(name, 5000).splitlines() if "torchft::" not in line]
            drained = True
            if pod == WORKER_POD:  # the worker services drained: NOT_SERVING, then stopped
                said = f"{c['name']} shutting down (SIGTERM): NOT_SERVING, draining"
                drained = any(said in line for line in own) and any(
                    f"{c['name']} stopped" in line for line in own
                )
            if code != 0 or not drained:
                unclean[name] = (code, "\n".join(own[-15:]))
    assert unclean == {}, "\n\n".join(f"{n}: exit {c}\n{tail}" for n, (c, tail) in unclean.items())
