"""`podrl run` of several CPU pods as a user starts it, for the multi-pod end-to-end tests
(test_scale_e2e.py, test_async_e2e.py): the run config of a tiny model on CPU, the `podrl run`
process and what the tests watch of it (status, steps, the replicas' parameter digests), the
pids of a pod's services, and the records the run leaves."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from podrl.common.auth import OPERATOR, load_run_secret
from podrl.common.grpc_options import open_channel
from podrl.config.auth import SECRET_FILE_ENV, AuthConfig
from podrl.config.transport import GrpcConfig
from podrl.models.tiny import make_tiny_model
from podrl.v1 import trainer_pb2, trainer_pb2_grpc
from tests.foundation.run_secret import credentials


def hold(while_file: Path) -> list[dict[str, Any]]:
    """Every trainer waits a moment before its gradients cross pods, while ``while_file``
    exists, so the SIGKILL of one lands before the exchange: the others then answer ABORTED and
    the step is sent again, re-split. Deleting the file ends the waits."""
    return [
        {
            "point": "trainer.before_cross_pod_allreduce",
            "action": "delay",
            "seconds": 1.5,
            "times": 0,
            "while_file": str(while_file),
        }
    ]


GROUP = 4


def write_config(
    tmp_path: Path,
    name: str,
    controller: dict[str, Any],
    reward: dict[str, Any],
    loop: dict[str, Any],
) -> tuple[Path, Path]:
    """A tiny random-init model on CPU, the copy task scored by ``reward``, ``loop`` over the
    shared loop settings (groups of GROUP, 4 tokens, no checkpoints, no export): the config
    file and the run dir."""
    run_dir = tmp_path / "run"
    model = make_tiny_model(tmp_path / "tiny")
    config = {
        "name": name,
        "run_dir": str(run_dir),
        "device": "cpu",
        "controller": {
            "heartbeat_interval_seconds": 0.5,
            "heartbeat_timeout_seconds": 3,
            **controller,
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
                    "rewards": [reward],
                }
            ]
        },
        "loop": {
            "sampling": {"n": GROUP, "max_tokens": 4, "temperature": 1.0},
            "checkpoint_every": 0,
            "max_step_attempts": 5,
            "export_at_end": False,
            **loop,
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, run_dir


def children(pid: int) -> list[int]:
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


def service_pid(launcher: int, service: str, pod: str) -> int:
    """The pid of ``pod``'s ``service`` process (a direct child of the launcher)."""
    for pid in children(launcher):
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

    def __init__(
        self, config: Path, run_dir: Path, log: Path, *, gate: Path, pods: int = 1
    ) -> None:
        """``gate``: while this file exists the trainers stall before their cross-pod
        exchange (:func:`hold`) and the test's paced reward is slow."""
        self.run_dir = run_dir
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "podrl.cli", "run", str(config), "--pods", str(pods)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "COLUMNS": "200", "PODRL_FAULTS": json.dumps(hold(gate))},
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
            self.pids.update(children(self.process.pid))
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


def training(status: dict[str, Any]) -> list[str]:
    return [p["id"] for p in status.get("pods", []) if p["state"] == "training"]


def records(run_dir: Path) -> list[dict[str, Any]]:
    """The step records, read from the run database the controller left."""
    with sqlite3.connect(run_dir / "controller.sqlite") as db:
        rows = db.execute("SELECT step, policy_version, metrics FROM steps ORDER BY step")
        return [
            {"step": step, "policy_version": version, "metrics": json.loads(metrics)}
            for step, version, metrics in rows
        ]


def stop(run: Run) -> None:
    """End the `podrl run` process if the scenario left it running (SIGINT, then SIGKILL)."""
    if run.process.poll() is None:
        run.process.send_signal(signal.SIGINT)
        try:
            run.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            run.process.kill()


def outputs(run: Run) -> dict[str, Any]:
    """What the run left: its log, samples.jsonl, summary.json and the step records."""
    return {
        "log": run.log.read_text(errors="replace"),
        "samples": [
            json.loads(line) for line in (run.run_dir / "samples.jsonl").read_text().splitlines()
        ],
        "summary": json.loads((run.run_dir / "summary.json").read_text()),
        "records": records(run.run_dir),
    }
