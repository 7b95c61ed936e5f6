"""The rendered chart's pods run: the controller Deployment's pod and a worker pod of the
StatefulSet, each container started from its image's real command with the manifest's env,
args and volume mounts (tests/k8s/local_pod.py says how each part is emulated), reach SERVING
on the ports their probes name; the worker pod registers and the controller is ready.

Pod starts: the default values (GPUs through DRA; on this CPU machine the trainer's and
generator's ``device: auto`` picks the CPU), and the CPU variant of ``k8s/podrl-cpu.yaml``
with its model from a PVC (the default install's model comes from the ``tiny`` init
container) and ``workers.replicas: 2`` (pod 0 runs here). The controller pod's second
container, the torchft Lighthouse (``podrl-lighthouse`` from the trainer image), starts too;
the worker pod's trainer is given its address through the controller Service. The
device-plugin fallback runs the very same processes as the default values (checked below,
without a start): only the GPU resources and NVIDIA_* variables differ.

Loopback stands for the cluster network: the controller Service's DNS name and the pod IPs map
to 127.0.0.1. The manifest's ports are used when free on this machine; a busy one is remapped
to a free port through its PODRL_* override in every container of both pods. The grader's
Prometheus port is held busy by the test, so the remapping runs on every start.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import secrets
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from podrl.tools.render_k8s import RUN_SECRET, VARIANTS
from tests.k8s.local_pod import (
    VENV_BIN,
    LocalPod,
    PodError,
    port_is_free,
    wait_until,
)
from tests.k8s.manifests import NAMESPACE, RELEASE, find, render

CONTROLLER_HOST = f"{RELEASE}-controller.{NAMESPACE}.svc"
WORKER_POD = f"{RELEASE}-worker-0"
CONTROLLER_POD = f"{RELEASE}-controller-6d5f8b7c9d-x4k2p"  # a Deployment pod's name
READY_TIMEOUT = 480
HELD_PORT = ("grader-prom", 9102)  # kept busy during each start: exercises the remapping
# The run-config override behind each named container port (to remap a busy port).
PORT_FIELDS = {
    "grpc": "PODRL_CONTROLLER__GRPC_PORT",
    "http": "PODRL_CONTROLLER__HTTP_PORT",
    "lighthouse": "PODRL_TRAINER__REPLICATION__LIGHTHOUSE_BIND",
    **{
        f"{service}-{kind}": f"PODRL_{service.upper()}__{field}"
        for service in ("trainer", "generator", "grader")
        for kind, field in (("grpc", "GRPC_PORT"), ("prom", "METRICS_PORT"))
    },
}
# The override's value for a local port (the Lighthouse's field is a bind address).
PORT_VALUES = {"lighthouse": "0.0.0.0:{port}"}
LIGHTHOUSE_ADDRESS = "PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS"
NVIDIA_VARIABLES = {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}

CPU_VARIANT = next(v for v in VARIANTS if v.filename == "podrl-cpu.yaml")
CPU_WITH_MODEL_PVC = {
    **CPU_VARIANT.chart_values,
    "model": {"source": "pvc", "pvc": {"claimName": "models"}, "folder": "tiny"},
    "workers": {**CPU_VARIANT.chart_values.get("workers", {}), "replicas": 2},
}
STARTS = {"default": {}, "cpu": CPU_WITH_MODEL_PVC}


def _pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        "controller": find(objects, "Deployment")["spec"]["template"]["spec"],
        "worker": find(objects, "StatefulSet")["spec"]["template"]["spec"],
    }


def _process_view(objects: list[dict[str, Any]], drop_env: set[str]) -> dict[str, Any]:
    """What decides how a pod's processes run: commands, env, mounts, volumes (no resources,
    scheduling or claims; the variables in ``drop_env`` left out)."""
    view = {}
    for pod_name, pod in _pods(objects).items():
        containers = []
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            containers.append(
                {
                    key: c.get(key)
                    for key in ("name", "image", "command", "args", "workingDir", "volumeMounts")
                }
                | {"env": [e for e in c.get("env", []) if e["name"] not in drop_env]}
            )
        view[pod_name] = {"containers": containers, "volumes": pod["volumes"]}
    return view


def test_the_device_plugin_pod_runs_the_same_processes_as_the_default() -> None:
    """One pod start covers both GPU modes: locally they differ in nothing that runs."""
    default = render({})
    device_plugin = render({"gpu": {"mode": "devicePlugin"}})
    assert _process_view(device_plugin, NVIDIA_VARIABLES) == _process_view(default, set())
    worker = _pods(device_plugin)["worker"]
    with_nvidia_env = {
        c["name"] for c in worker["containers"] if NVIDIA_VARIABLES & {e["name"] for e in c["env"]}
    }
    assert with_nvidia_env == {"generator", "grader"}  # not the container holding the GPUs


def _port_map(pods: dict[str, dict[str, Any]]) -> tuple[dict[int, int], dict[str, str]]:
    """Manifest port -> local port (itself when free), and the overrides of remapped ones."""
    named = {
        p["name"]: p["containerPort"]
        for pod in pods.values()
        for c in pod["containers"]
        for p in c.get("ports", [])
    }
    port_map: dict[int, int] = {}
    overrides: dict[str, str] = {}
    for name, port in named.items():
        if port_is_free(port):
            port_map[port] = port
            continue
        with socket.socket() as sock:
            sock.bind(("0.0.0.0", 0))
            port_map[port] = sock.getsockname()[1]
        overrides[PORT_FIELDS[name]] = PORT_VALUES.get(name, "{port}").format(port=port_map[port])
    return port_map, overrides


@dataclass
class RunningRelease:
    name: str
    objects: list[dict[str, Any]]
    controller: LocalPod
    worker: LocalPod
    run_secret: bytes
    remapped: dict[str, str]
    """PODRL_* port overrides given to every container (ports busy on this machine)."""

    @property
    def pods(self) -> tuple[LocalPod, LocalPod]:
        return self.controller, self.worker

    def rest(self, path: str) -> httpx.Response:
        controller = self.controller.container("controller")
        port = self.controller.port(controller, "http")
        return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=5)


def _run_secret(objects: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bytes]:
    """The rendered Secret, or the one the user creates (`kubectl create secret`) when the
    values name an existing Secret."""
    rendered = [o for o in objects if o["kind"] == "Secret"]
    if rendered:
        (secret,) = rendered
        return objects, base64.b64decode(next(iter(secret["data"].values())))
    value = secrets.token_hex(32).encode()
    created = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": RUN_SECRET, "namespace": NAMESPACE},
        "data": {"run-secret": base64.b64encode(value).decode()},
    }
    return [*objects, created], value


@pytest.fixture(scope="module", params=sorted(STARTS))
def running(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[RunningRelease]:
    name = request.param
    base = tmp_path_factory.mktemp(f"pod-{name}")
    objects, run_secret = _run_secret(render(STARTS[name], skip_tests=True))
    pods = _pods(objects)
    held = socket.socket()
    with contextlib.suppress(OSError):  # already busy: remapped all the same
        held.bind(("0.0.0.0", HELD_PORT[1]))
    port_map, overrides = _port_map(pods)
    statefulset = find(objects, "StatefulSet")
    claim_templates = tuple(
        t["metadata"]["name"] for t in statefulset["spec"].get("volumeClaimTemplates", [])
    )
    volume_dirs = {}
    if name == "cpu":
        # The model PVC: filled the way a user would, with podrl's own tiny-model maker.
        models = base / "pvc-models"
        subprocess.run(
            [str(VENV_BIN / "podrl"), "make-tiny-model", str(models / "tiny")],
            check=True,
            capture_output=True,
        )
        volume_dirs["model"] = models
    common = {
        "namespace": NAMESPACE,
        "hosts": {CONTROLLER_HOST: "127.0.0.1"},
        "port_map": port_map,
        "extra_env": overrides,
    }
    controller = LocalPod(CONTROLLER_POD, pods["controller"], objects, base / "c", **common)
    worker = LocalPod(
        WORKER_POD,
        pods["worker"],
        objects,
        base / "w",
        claim_templates=claim_templates,
        volume_dirs=volume_dirs,
        **common,
    )
    release = RunningRelease(name, objects, controller, worker, run_secret, overrides)
    try:
        controller.start()
        worker.start()

        def serving() -> bool:
            return all(
                pod.probe(c, "readinessProbe") == _ready_answer(c.spec["readinessProbe"])
                for pod in release.pods
                for c in pod.main_containers()
            )

        def alive() -> None:
            controller.check_running()
            worker.check_running()

        wait_until(serving, READY_TIMEOUT, alive, f"every container of the {name} pods")
        yield release
    finally:
        worker.stop()
        controller.stop()
        worker.cleanup()
        controller.cleanup()
        held.close()


def _ready_answer(probe: dict[str, Any]) -> str:
    """What a passing probe answers: 200 for httpGet, SERVING for gRPC health."""
    return "200" if "httpGet" in probe else "SERVING"


@pytest.mark.slow
def test_every_container_reports_serving_on_the_port_its_probes_name(
    running: RunningRelease,
) -> None:
    names = {c.name for c in running.controller.main_containers()}
    assert names == {"controller", "lighthouse"}
    for pod in running.pods:
        for c in pod.main_containers():
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                expected = _ready_answer(c.spec[kind])
                assert pod.probe(c, kind) == expected, (running.name, c.name, kind)


@pytest.mark.slow
def test_the_worker_pod_registers_and_the_controller_is_ready(running: RunningRelease) -> None:
    def registered() -> bool:
        status = running.rest("/v1/status").json()
        return status["healthy_pods"] == [WORKER_POD]

    wait_until(registered, 60, lambda: None, "the worker pod's registration")
    status = running.rest("/v1/status").json()
    components = {(w["worker_id"], w["component"]) for w in status["workers"] if w["healthy"]}
    assert components == {(WORKER_POD, c) for c in ("trainer", "generator", "grader")}
    ready = running.rest("/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["healthy_pods"] == [WORKER_POD]


@pytest.mark.slow
def test_a_busy_port_is_remapped_for_every_container(running: RunningRelease) -> None:
    name, manifest_port = HELD_PORT
    local = int(running.remapped[PORT_FIELDS[name]])
    assert local != manifest_port
    for pod in running.pods:
        for c in pod.main_containers():
            assert c.env[PORT_FIELDS[name]] == str(local), c.name
    grader = running.worker.container("grader")
    assert running.worker.port(grader, "grader-prom") == local
    reply = httpx.get(f"http://127.0.0.1:{local}/metrics", timeout=5)
    assert reply.status_code == 200 and "podrl" in reply.text


@pytest.mark.slow
def test_every_container_reads_the_run_secret_from_its_mount(running: RunningRelease) -> None:
    """Every podrl service, the Lighthouse too (its front checks the trainers' replica ids)."""
    for pod in running.pods:
        for c in pod.main_containers():
            file = c.env["PODRL_RUN_SECRET_FILE"]
            assert file == str(c.path("/var/run/secrets/podrl/run-secret")), c.name
            assert Path(file).read_bytes() == running.run_secret, c.name


@pytest.mark.slow
def test_trainer_and_generator_load_one_read_only_model_folder(running: RunningRelease) -> None:
    trainer, generator = (running.worker.container(n) for n in ("trainer", "generator"))
    folders = {Path(c.path("/models")).resolve() for c in (trainer, generator)}
    assert len(folders) == 1
    (folder,) = folders
    model = folder / "tiny" if running.name == "cpu" else folder
    assert (model / "config.json").is_file()
    assert not any(path.stat().st_mode & 0o222 for path in (folder, *folder.rglob("*")))


@pytest.mark.slow
def test_the_trainer_gets_the_address_of_the_lighthouse_sidecar(running: RunningRelease) -> None:
    """The worker pod's trainer (pod 0 of ``replicas: 2`` in the cpu start) is given the
    Lighthouse through the controller Service; its running process reports that address,
    and there the controller pod's Lighthouse answers a torchft quorum request whose replica
    id carries the run secret's MAC, refuses one without, and serves no HTTP page."""
    from torchft.coordination import LighthouseClient

    from podrl.common.auth import CallerCredentials, load_run_secret
    from podrl.common.grpc_options import open_channel
    from podrl.config.auth import AuthConfig
    from podrl.config.transport import GrpcConfig
    from podrl.trainer.lighthouse_front import signed_replica_id
    from podrl.v1 import common_pb2, trainer_pb2_grpc

    if running.name == "cpu":
        assert find(running.objects, "StatefulSet")["spec"]["replicas"] == 2
    lighthouse = running.controller.container("lighthouse")
    local = f"127.0.0.1:{running.controller.port(lighthouse, 'lighthouse')}"
    trainer = running.worker.container("trainer")
    assert trainer.env[LIGHTHOUSE_ADDRESS] == local  # the Service's name and port, mapped here
    others = [*running.worker.main_containers(), *running.controller.main_containers()]
    assert [c.name for c in others if LIGHTHOUSE_ADDRESS in c.env] == ["trainer"]

    secret_env = {"PODRL_RUN_SECRET_FILE": trainer.env["PODRL_RUN_SECRET_FILE"]}
    credentials = CallerCredentials.for_role("controller", CONTROLLER_POD, AuthConfig(), secret_env)
    port = running.worker.port(trainer, "trainer-grpc")
    with open_channel(f"127.0.0.1:{port}", GrpcConfig(), credentials) as channel:
        info = trainer_pb2_grpc.TrainerStub(channel).Info(common_pb2.InfoRequest(), timeout=30)
    assert info.info.details["lighthouse"] == local

    client = LighthouseClient(f"http://{local}", connect_timeout=timedelta(seconds=10))
    secret = load_run_secret(AuthConfig(), secret_env)
    pod = f"{WORKER_POD}-probe"
    probe = f"{signed_replica_id(secret, pod, 'http://127.0.0.1:1', '127.0.0.1:2')}:u"

    def join(replica_id: str) -> object:
        return client.quorum(
            replica_id=replica_id,
            timeout=timedelta(seconds=30),
            address="http://127.0.0.1:1",
            store_address="127.0.0.1:2",
            step=0,
            world_size=1,
        )

    assert [member.replica_id for member in join(probe).participants] == [probe]
    with pytest.raises(Exception, match=r"UNAUTHENTICATED|Unauthenticated"):
        join(pod)
    with contextlib.suppress(httpx.HTTPError):  # no response at all: the front is gRPC only
        assert httpx.get(f"http://{local}/status", timeout=5).status_code != 200


def test_a_pod_whose_volume_is_read_only_and_writable_at_once_is_refused(tmp_path) -> None:
    """The emulation cannot give two containers two views of one folder; it says so."""
    objects, _ = _run_secret(copy.deepcopy(render({})))
    pod = _pods(objects)["worker"]
    trainer = next(c for c in pod["containers"] if c["name"] == "trainer")
    shared = {"name": "model", "mountPath": "/models"}  # writable here, read-only elsewhere
    trainer["volumeMounts"] = [m for m in trainer["volumeMounts"] if m["name"] != "model"]
    trainer["volumeMounts"].append(shared)
    local = LocalPod(
        WORKER_POD, pod, objects, tmp_path, namespace=NAMESPACE, claim_templates=("run-state",)
    )
    try:
        with pytest.raises(PodError, match=r"\['model'\] are mounted read-only and writable"):
            local.prepare()
    finally:
        local.cleanup()
