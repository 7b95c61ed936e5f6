"""The rendered chart's pods in real containers: the CPU variant (model source ``tiny``)
rendered by the real helm, the controller Deployment's pod (controller and Lighthouse) and one
worker pod of the StatefulSet (its ``model`` init container first) played with
``podman kube play`` from the built images (``make images VARIANT=cpu``), on a test network
where the controller Service's name resolves to the controller pod (tests/k8s/podman_pod.py says
what is done for the kubelet and the API server). A GRPO run trains inside them; once it is
going, the StatefulSet's pod for ordinal 1 is played and ``podrl scale`` brings it into the run.

Skipped, saying why, without podman or the images. Marked ``containers`` (``make
test-containers``) and ``slow``: `make test` does not run it.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from podrl.common.grpc_options import open_channel
from podrl.config.transport import GrpcConfig
from podrl.tools.render_k8s import RUN_SECRET, VARIANTS
from podrl.v1 import trainer_pb2, trainer_pb2_grpc
from tests.foundation.run_secret import credentials
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

STEPS = 200
# The run must last past a second worker pod's start (40 to 120 s here, minutes under load),
# and a step of the tiny model takes under a second: while the file GATE exists, the grader's
# reward (tests/controller/paced_reward.py, mounted into the grader container as a plug-in)
# takes DELAY seconds a sample, as in the process scale-out tests. The test removes GATE once
# the second pod has joined and left; the rest of the run goes at full speed.
PACING = "/opt/podrl-pacing"  # the plug-in's folder in the grader container
GATE = "slow-steps"
DELAY = 1.0
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
        # The copy task scored by the paced reward (its value varies with the completion, so
        # groups have reward variance and steps train).
        "tasks": {
            "definitions": [
                {
                    "name": "copy",
                    "source": {"kind": "procedural", "generator": "copy", "alphabet": "abc"},
                    "template": "{question}",
                    "rewards": [
                        {
                            "name": "paced_reward:paced_varied",
                            "params": {"gate": f"{PACING}/{GATE}", "delay": DELAY},
                        }
                    ],
                }
            ]
        },
    },
}
CONTROLLER_POD = f"{RELEASE}-controller-6d5f8b7c9d-x4k2p"  # a Deployment pod's name
WORKER_POD = f"{RELEASE}-worker-0"
SECOND_POD = f"{RELEASE}-worker-1"  # the StatefulSet's pod for ordinal 1
CONTROLLER_SERVICE = f"{RELEASE}-controller"
READY_TIMEOUT = 600
RUN_TIMEOUT = 1200
# The run's folder (values.yaml's run_dir): the controller's records and samples.jsonl, the
# trainer's export (loop.export_at_end).
RUN_DIR = "/var/lib/podrl/runs/podrl"
EXPORTS = f"{RUN_DIR}/export"


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
    play_pod: Callable[[str, str], None]
    """Plays the worker pod template as the named pod at the given IP."""
    gate: Path
    """The pacing gate on the host (see GATE)."""
    joined: dict[str, Any] = field(default_factory=dict)
    """What the second pod's join left for the checks after the run."""

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
    for pod in (SECOND_POD, WORKER_POD, CONTROLLER_POD):
        podman("pod", "rm", "-f", "-t", "5", pod, check=False)
    for volume in volumes:
        podman("volume", "rm", "-f", volume, check=False)
    podman("network", "rm", "-f", network, check=False)


def _mount_pacing(spec: dict[str, Any], folder: Path) -> None:
    """The grader container of the worker pod template gets ``folder`` (the paced reward and
    its gate) read-only at PACING, on its PYTHONPATH: a test plug-in, not part of the chart."""
    spec["volumes"].append(
        {"name": "pacing", "hostPath": {"path": str(folder), "type": "Directory"}}
    )
    (grader,) = [c for c in spec["containers"] if c["name"] == "grader"]
    grader["volumeMounts"].append({"name": "pacing", "mountPath": PACING, "readOnly": True})
    grader["env"].append({"name": "PYTHONPATH", "value": PACING})


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
    pacing = folder / "pacing"
    pacing.mkdir(mode=0o755)
    shutil.copy(Path(__file__).parents[1] / "controller" / "paced_reward.py", pacing)
    (pacing / GATE).touch()
    _mount_pacing(find(objects, "StatefulSet")["spec"]["template"]["spec"], pacing)
    try:
        podman("network", "create", "--subnet", f"{subnet}.0/24", network)

        def play_pod(name: str, ip: str, kind: str = "StatefulSet") -> None:
            spec = find(objects, kind)["spec"]["template"]["spec"]
            pod, pod_volumes = pod_manifest(
                name,
                spec,
                objects,
                namespace=NAMESPACE,
                pod_ip=ip,
                hosts=hosts,
                folder=folder / name,
                volume_prefix=f"podrl-test-{tag}",
            )
            for volume, memory in pod_volumes.items():
                create_volume(volume, memory, spec["containers"][0]["image"])
                volumes.append(volume)
            play(pod, folder / f"{name}.yaml", network, ip)

        play_pod(CONTROLLER_POD, controller_ip, "Deployment")
        play_pod(WORKER_POD, worker_ip)
        release = Release(objects, controller_ip, worker_ip, value, play_pod, pacing / GATE)

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


def _training(status: dict[str, Any]) -> list[str]:
    return sorted(p["id"] for p in status.get("pods", []) if p["state"] == "training")


def _scale(release: Release, replicas: int) -> None:
    """``podrl scale`` from the host, signed with the run secret, as an operator runs it."""
    done = subprocess.run(
        [sys.executable, "-m", "podrl.cli", "scale", "--replicas", str(replicas),
         "--url", f"http://{release.controller_ip}:8080"],
        env={**os.environ, "PODRL_RUN_SECRET": release.run_secret.decode()},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert release.status()["desired_replicas"] == replicas


def _digests(release: Release, ips: dict[str, str]) -> dict[str, Any]:
    """Each pod's trainer's ParametersDigest, asked as the controller asks (the run secret)."""
    env = {"PODRL_RUN_SECRET": release.run_secret.decode()}
    digests = {}
    for pod, ip in ips.items():
        channel = open_channel(f"{ip}:50053", GrpcConfig(), credentials(env=env))
        try:
            stub = trainer_pb2_grpc.TrainerStub(channel)
            digests[pod] = stub.ParametersDigest(trainer_pb2.ParametersDigestRequest(), timeout=60)
        finally:
            channel.close()
    return digests


def test_a_second_worker_pod_joins_with_podrl_scale(release: Release) -> None:
    """Mid-run, the StatefulSet's pod for ordinal 1 is played and ``podrl scale --replicas 2``
    asks for it: its trainer heals from the first pod's through the Lighthouse (torchft) and
    both pods train the same steps with equal parameters. Then ``podrl scale --replicas 1``
    and SIGTERM to that pod, as a scale-down stops it: it drains and one pod trains on. The
    run's records are checked once it has finished (below)."""

    def going() -> bool:
        status = release.status()
        assert status["phase"] != "failed", status["error"]
        return status["step"] >= 1

    wait_until(going, RUN_TIMEOUT, lambda: None, "the run's first step")
    played_at = release.status()["step"]
    second_ip = release.worker_ip.rsplit(".", 1)[0] + ".21"
    release.play_pod(SECOND_POD, second_ip)
    _scale(release, 2)
    names = [c["name"] for c in release.containers()[WORKER_POD]]

    def both_train() -> bool:
        status = release.status()
        assert status["phase"] not in ("finished", "stopped", "failed"), (
            f"the run is {status['phase']} at step {status['step']} before {SECOND_POD} "
            f"joined: raise STEPS ({STEPS}) so that it outlasts a pod's start"
        )
        return _training(status) == [WORKER_POD, SECOND_POD]

    wait_until(both_train, READY_TIMEOUT, lambda: _running(SECOND_POD, names), "two pods")
    ips = {WORKER_POD: release.worker_ip, SECOND_POD: second_ip}

    def equal() -> bool:
        digests = _digests(release, ips)
        if len({d.policy_version for d in digests.values()}) != 1:
            return False  # a step in between: ask again
        assert len({d.sha256 for d in digests.values()}) == 1, digests
        return True

    wait_until(equal, 300, lambda: None, "both trainers at one policy version")

    def sampled() -> bool:  # the new pod's generator gets its share of a step's prompts too
        found = podman(
            "exec", f"{CONTROLLER_POD}-controller", "grep", "-q", f'"{SECOND_POD}"',
            f"{RUN_DIR}/samples.jsonl", check=False,
        )  # fmt: skip
        return found.returncode == 0

    wait_until(sampled, 300, lambda: None, f"a sample generated by {SECOND_POD}")
    healed = [line for line in logs(f"{SECOND_POD}-trainer", 5000).splitlines() if "healed" in line]
    assert healed, logs(f"{SECOND_POD}-trainer")
    _scale(release, 1)
    grace = find(release.objects, "StatefulSet")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ]
    stop_pod(SECOND_POD, [f"{SECOND_POD}-{n}" for n in names], grace)
    for name in names:
        assert inspect(f"{SECOND_POD}-{name}")["State"]["ExitCode"] == 0, logs(
            f"{SECOND_POD}-{name}"
        )
    wait_until(lambda: _training(release.status()) == [WORKER_POD], 300, lambda: None, "one pod")
    release.joined.update(played_at=played_at, left_at=release.status()["step"])
    release.gate.unlink()
    podman("pod", "rm", "-f", SECOND_POD)


def test_the_grpo_run_finishes_and_its_export_loads(release: Release, tmp_path) -> None:
    release.gate.unlink(missing_ok=True)  # full speed, whatever the join test did

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


def test_no_step_or_prompt_was_lost_or_repeated_across_the_join(release: Release, tmp_path) -> None:
    """What the scale-out tests check of processes: every step trained once (one policy
    version per trained step, never two), the steps between the join and the drain trained by
    both pods, every prompt sampled once, every sample by the policy version of its step."""
    assert release.joined, "the second pod did not join (see the test above)"
    podman("cp", f"{CONTROLLER_POD}-controller:{RUN_DIR}", str(tmp_path / "run"))
    with sqlite3.connect(tmp_path / "run" / "controller.sqlite") as db:
        rows = db.execute("SELECT step, policy_version, metrics FROM steps ORDER BY step")
        records = [(step, version, json.loads(metrics)) for step, version, metrics in rows]
    assert [step for step, *_ in records] == list(range(1, STEPS + 1))
    version, version_before = 0, {1: 0}
    for step, policy_version, metrics in records:
        version += bool(metrics["trained"])
        assert policy_version == version, (step, metrics)
        version_before[step + 1] = version
    both = [s for s, _, m in records if m["trained"] and len(m["pods"]) == 2]
    assert both and set(both) <= set(
        range(release.joined["played_at"], release.joined["left_at"] + 1)
    )
    samples = [
        json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    ]
    prompts = [(row["prompt_id"], row["step"], row["pod"]) for row in samples]
    by_prompt: dict[str, set[tuple[int, str]]] = {}
    for prompt, step, pod in prompts:
        by_prompt.setdefault(prompt, set()).add((step, pod))
    assert all(len(where) == 1 for where in by_prompt.values())
    assert {row["pod"] for row in samples} == {WORKER_POD, SECOND_POD}
    for row in samples:
        assert row["policy_version"] == version_before[row["step"]], row


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
            # torchft's client logs every failed heartbeat: its lines would hide the service's
            # in the tail shown. Its Rust logger also writes unbuffered, so one of its lines
            # can share a line with the service's: the drain is looked for in the whole text.
            text = logs(name, 5000)
            own = [line for line in text.splitlines() if "torchft::" not in line]
            drained = True
            if pod == WORKER_POD:  # the worker services drained: NOT_SERVING, then stopped
                said = f"{c['name']} shutting down (SIGTERM): NOT_SERVING, draining"
                drained = said in text and f"{c['name']} stopped" in text
            if code != 0 or not drained:
                unclean[name] = (code, "\n".join(own[-15:]))
    assert unclean == {}, "\n\n".join(f"{n}: exit {c}\n{tail}" for n, (c, tail) in unclean.items())
