"""Real processes for the cross-pod tests: a ``podrl-lighthouse`` and trainer services (one gloo
rank each) that stand in for worker pods, plus helpers to split a batch into pods' shares."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from safetensors.torch import load_file

from podrl.common.auth import AuthClientInterceptor, CallerCredentials
from podrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from tests.trainer.rank_worker import config_env, free_port

# Short Lighthouse timeouts so a dead pod leaves the quorum within a second.
LIGHTHOUSE_ENV = {
    "PODRL_TRAINER__REPLICATION__HEARTBEAT_TIMEOUT_SECONDS": "1",
    "PODRL_TRAINER__REPLICATION__JOIN_TIMEOUT_SECONDS": "1",
}
# The trainers' side: a stuck step fails within a minute, not the defaults' minutes.
REPLICA_ENV = {
    "PODRL_TRAINER__REPLICATION__QUORUM_TIMEOUT_SECONDS": "60",
    "PODRL_TRAINER__REPLICATION__COLLECTIVE_TIMEOUT_SECONDS": "60",
    "PODRL_TRAINER__REPLICATION__CONNECT_TIMEOUT_SECONDS": "10",
}


def no_auth_env() -> dict[str, str]:
    """These tests are about replication, not authentication: run the services without it
    (where the run config has an auth section)."""
    from podrl.config import RunConfig

    return {"PODRL_AUTH__DISABLED": "true"} if "auth" in RunConfig.model_fields else {}


def _wait_for_text(path: Path, text: str, process: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert process.poll() is None, f"{path.name} exited:\n{path.read_text()}"
        assert time.monotonic() < deadline, f"no {text!r} in {path}:\n{path.read_text()}"
        time.sleep(0.2)


@dataclass
class Lighthouse:
    process: subprocess.Popen[bytes]
    address: str
    """The front's host:port: what the trainers are given."""
    server_address: str
    """The torchft Lighthouse's own host:port, on loopback."""
    log_path: Path

    def status(self) -> str:
        """The torchft Lighthouse's status page (quorum, heartbeating replica ids), read where
        it listens: on loopback, behind the front."""
        return httpx.get(f"http://{self.server_address}/status", timeout=10).text

    def stop(self) -> int:
        """SIGTERM; the exit code (killed after 10 s: -9)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_lighthouse(tmp: Path, *, auth: bool = False) -> Lighthouse:
    """``python -m podrl.trainer.lighthouse`` on a free loopback port, once it listens; with
    ``auth`` it checks the replica ids with the run secret the tests share."""
    port = free_port()
    log_path = tmp / "lighthouse.log"
    env = {
        **os.environ,
        **LIGHTHOUSE_ENV,
        **({} if auth else no_auth_env()),
        "PODRL_RUN_DIR": str(tmp),
    }
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "podrl.trainer.lighthouse", "--bind", f"127.0.0.1:{port}"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    _wait_for_text(log_path, "lighthouse listening on", process, 60)
    server = re.search(r"the torchft Lighthouse on (\S+),", log_path.read_text())
    assert server, log_path.read_text()
    return Lighthouse(process, f"127.0.0.1:{port}", server.group(1), log_path)


@dataclass(eq=False)  # hashable by identity: tests key requests by pod
class Pod:
    """One pod's trainer service."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    channel: grpc.Channel = field(repr=False)
    stub: trainer_pb2_grpc.TrainerStub = field(repr=False)

    def info(self) -> trainer_pb2.TrainerInfo:
        return self.stub.Info(common_pb2.InfoRequest(), timeout=30)

    def digest(self) -> trainer_pb2.ParametersDigestResponse:
        return self.stub.ParametersDigest(trainer_pb2.ParametersDigestRequest(), timeout=60)

    def parameters(self, path: Path) -> dict[str, torch.Tensor]:
        """The full parameters, through ExportHF (a safetensors folder named ``path.name``
        under the pod's run directory: the trainer writes nowhere else)."""
        folder = self.log_path.parent / self.name / "exports" / path.name  # see start_pods
        self.stub.ExportHF(trainer_pb2.ExportHFRequest(path=str(folder)), timeout=120)
        return load_file(folder / "model.safetensors")

    def log(self) -> str:
        return self.log_path.read_text()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.channel.close()


def start_pods(
    model_dir: Path,
    tmp: Path,
    names: Sequence[str],
    *,
    lighthouse: str | None,
    extra_env: dict[str, dict[str, str]] | None = None,
    timeout: float = 240,
    dp_shard: int = 1,
    credentials: CallerCredentials | None = None,
    **trainer: object,
) -> dict[str, Pod]:
    """Start one trainer service per name (its worker id), all at once, each of ``dp_shard``
    FSDP2 gloo ranks; return them SERVING. ``lighthouse`` None = no cross-pod replication
    (today's single-pod trainer). With ``credentials`` (the controller's) the trainers check
    callers with the run secret the tests share, and the pods' channels carry them."""
    started: dict[str, Pod] = {}
    for name in names:
        port = free_port()
        run_dir = tmp / name
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {
            **os.environ,
            **config_env(str(model_dir), str(run_dir), dp_shard=dp_shard, **trainer),
            "PODRL_WORKER_ID": name,
            "PODRL_TRAINER__GRPC_PORT": str(port),
            "PODRL_TRAINER__METRICS_PORT": "0",
            "PODRL_CONTROLLER__GRPC_PORT": str(free_port()),  # no controller: registration retries
            "OMP_NUM_THREADS": "1",
            **({} if credentials else no_auth_env()),
            **REPLICA_ENV,
            **((extra_env or {}).get(name, {})),
        }
        if lighthouse is not None:
            env["PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS"] = lighthouse
        log_path = tmp / f"{name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "podrl.trainer"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        if credentials is not None:
            channel = grpc.intercept_channel(channel, AuthClientInterceptor(credentials))
        started[name] = Pod(
            name, process, port, log_path, channel, trainer_pb2_grpc.TrainerStub(channel)
        )
    try:
        deadline = time.monotonic() + timeout
        for pod in started.values():
            health = health_pb2_grpc.HealthStub(pod.channel)
            request = health_pb2.HealthCheckRequest(service="podrl.v1.Trainer")
            while True:
                assert pod.process.poll() is None, pod.log()
                try:
                    if (
                        health.Check(request, timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"{pod.name} did not start:\n{pod.log()}"
                time.sleep(0.5)
    except BaseException:
        for pod in started.values():
            pod.kill()
        raise
    return started


def share(
    batch: trainer_pb2.TrainRequest,
    indices: Sequence[int],
    batch_id: str,
    pods: int,
    pod_ids: Sequence[str] = (),
) -> trainer_pb2.TrainRequest:
    """The pod's share of ``batch``: the sequences at ``indices``, with the batch-wide totals
    (and the step's pods by worker id when given)."""
    out = trainer_pb2.TrainRequest(
        policy_version=batch.policy_version,
        batch_id=batch_id,
        global_sequences=len(batch.sequences),
        global_completion_tokens=sum(len(s.completion_ids) for s in batch.sequences),
        pods=pods,
        pod_ids=pod_ids,
    )
    out.sequences.extend(batch.sequences[i] for i in indices)
    return out


def train_together(
    requests: Mapping[Pod, trainer_pb2.TrainRequest], timeout: float
) -> dict[str, object]:
    """Send each pod its request at the same time; each pod's reply or RpcError, by name."""
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = {
            pod.name: pool.submit(pod.stub.Train, request, timeout=timeout)
            for pod, request in requests.items()
        }
    out: dict[str, object] = {}
    for name, future in futures.items():
        try:
            out[name] = future.result()
        except grpc.RpcError as err:
            out[name] = err
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def fault_plan(*rules: dict[str, object]) -> dict[str, str]:
    return {"PODRL_FAULTS": json.dumps(list(rules))}
