"""End to end: during a real run — the four service processes `podrl run` starts
(LocalCluster), real vLLM, real gRPC, real shared memory — a client without the run secret
tries to register as the pod's trainer, to Train, to ApplyWeights a forged manifest and to Drain
the trainer, again and again while the run steps. Every call gets UNAUTHENTICATED, and the run's
steps, samples, trained weights (the trainer's parameter digest) and served weights (logprobs of
a fixed prompt) are exactly those of an undisturbed run with the same seeds.

Before authentication each of these calls changed
the run: the fake trainer got batches, the extra Train was recorded as a step, the forged
manifest poisoned generation, the Drain made /readyz 503.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from podrl.cli.local_cluster import WORKER_ID, LocalCluster
from podrl.common.auth import CallerCredentials, RunSecret
from podrl.common.grpc_options import open_channel
from podrl.config import load_config
from podrl.config.transport import GrpcConfig
from podrl.models.tiny import make_tiny_model
from podrl.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    generator_pb2,
    generator_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weights_pb2,
)

# Two runs of four processes each (about 4.5 minutes on an idle 2-core machine; the suite's
# 600 s default is too tight when other tests load the machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

STEPS = 3
FIXED_PROMPT = "abcab"


def _config(run_dir: Path, model: Path) -> Path:
    config = {
        "name": "auth-e2e",
        "run_dir": str(run_dir),
        "device": "cpu",
        "controller": {"heartbeat_interval_seconds": 0.5, "heartbeat_timeout_seconds": 5},
        "grader": {"workers": 1},
        "generator": {"model_path": str(model)},
        "trainer": {"model_path": str(model), "lr": 1.0e-3, "seed": 3},
        "tasks": {
            "seed": 5,
            "definitions": [
                {
                    "name": "copy",
                    "source": {"kind": "procedural", "generator": "copy", "alphabet": "abc"},
                    "template": "{question}",
                    "target_template": "{answer}\n",
                    # Partial credit: a random-init model's completions differ in reward within
                    # some groups, so steps train (no warm-start needed).
                    "rewards": [{"name": "char_match", "params": {"stop": "\n"}}],
                }
            ],
        },
        "loop": {
            "steps": STEPS,
            "prompts_per_step": 6,
            "sampling": {
                "n": 6,
                "max_tokens": 4,
                "stop": ["\n"],
                "temperature": 1.0,
                "seed": 11,
            },
            "checkpoint_every": 0,
            "export_at_end": False,
        },
        "tracking": {"tensorboard": False},
    }
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _status(cluster: LocalCluster) -> dict[str, Any]:
    try:
        return httpx.get(f"{cluster.rest_url}/v1/status", timeout=5).json()
    except httpx.HTTPError:
        return {}


#: Fields that differ between any two runs: times, and the batch ids (they carry a random id
#: of the run, so that a trainer never mistakes one run's batch for another's).
RUN_SPECIFIC = ("finished_at", "time", "batch_id", "batch_ids")


def _comparable(value: Any) -> Any:
    """A record without the fields that differ between any two runs."""
    if isinstance(value, dict):
        return {
            k: _comparable(v)
            for k, v in value.items()
            if "seconds" not in k and "per_second" not in k and k not in RUN_SPECIFIC
        }
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    return value


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two records differ, one line each (readable assertion messages)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            line
            for key in sorted(set(a) | set(b), key=str)
            for line in _differences(a.get(key), b.get(key), f"{where}.{key}")
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [
            line
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for line in _differences(x, y, f"{where}[{i}]")
        ]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


class Intruder:
    """A process on the machine that knows the ports but not the run secret."""

    def __init__(self, cluster: LocalCluster) -> None:
        wrong = CallerCredentials(
            RunSecret(secrets.token_hex(32).encode(), "guess"), "controller", WORKER_ID
        )
        self.channels = {
            name: [
                open_channel(child.grpc_address, GrpcConfig(), None),
                open_channel(child.grpc_address, GrpcConfig(), wrong),
            ]
            for name, child in ((c.name, c) for c in cluster.children)
        }
        self.codes: dict[str, set[grpc.StatusCode]] = {}
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _attempts(self, name: str, channel: grpc.Channel) -> dict[str, Callable[[], object]]:
        if name == "controller":
            stub = controller_pb2_grpc.ControllerStub(channel)
            return {
                "Register": lambda: stub.Register(
                    controller_pb2.RegisterRequest(
                        worker_id=WORKER_ID,  # the real pod's id: take over its trainer
                        component=controller_pb2.COMPONENT_TRAINER,
                        address="127.0.0.1:9",
                        incarnation="intruder",
                    ),
                    timeout=5,
                ),
                "Drain": lambda: stub.Drain(
                    controller_pb2.DrainRequest(
                        worker_id=WORKER_ID, component=controller_pb2.COMPONENT_TRAINER
                    ),
                    timeout=5,
                ),
            }
        if name == "trainer":
            stub = trainer_pb2_grpc.TrainerStub(channel)
            sequence = trainer_pb2.TrainSequence(
                sample_id="x#0",
                prompt_ids=[1, 2],
                completion_ids=[3, 4],
                generator_logprobs=[-1.0, -1.0],
                advantage=1.0,
            )
            return {
                "Train": lambda: stub.Train(
                    trainer_pb2.TrainRequest(sequences=[sequence] * 4, batch_id="intruder"),
                    timeout=5,
                )
            }
        if name == "generator":
            stub = generator_pb2_grpc.GeneratorStub(channel)
            forged = weights_pb2.WeightManifest(
                version=10_000, model_fingerprint="forged", publisher_id=WORKER_ID
            )
            return {
                "ApplyWeights": lambda: stub.ApplyWeights(
                    generator_pb2.ApplyWeightsRequest(manifest=forged, rollback=True), timeout=5
                )
            }
        return {}

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, channels in self.channels.items():
                for channel in channels:
                    for rpc, call in self._attempts(name, channel).items():
                        try:
                            call()
                            code = grpc.StatusCode.OK
                        except grpc.RpcError as err:
                            code = err.code()
                        self.codes.setdefault(rpc, set()).add(code)
            self.rounds += 1
            self._stop.wait(0.2)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for channels in self.channels.values():
            for channel in channels:
                channel.close()


def _run(tmp_path: Path, name: str, model: Path, attacked: bool) -> dict[str, Any]:
    run_dir = tmp_path / name
    config_path = _config(run_dir, model)
    config = load_config(config_path, env={})
    cluster = LocalCluster(config, str(config_path))
    intruder = None
    observed: dict[str, Any] = {}
    try:
        cluster.start()
        cluster.wait_ready(timeout=400)
        if attacked:
            intruder = Intruder(cluster)
            intruder.start()
        deadline = time.monotonic() + 600
        while _status(cluster).get("phase") not in ("finished", "failed"):
            cluster.check_alive()
            assert time.monotonic() < deadline, "the run did not finish"
            time.sleep(0.3)
        if intruder is not None:
            intruder.stop()
            observed["intruder"] = intruder
        status = _status(cluster)
        assert status["phase"] == "finished", status.get("error")
        observed["workers"] = sorted(
            (w["worker_id"], w["component"], w["address"]) for w in status["workers"]
        )
        observed["steps"] = _comparable(httpx.get(f"{cluster.rest_url}/v1/steps", timeout=5).json())
        creds = cluster.credentials()
        with open_channel(cluster.child("trainer").grpc_address, GrpcConfig(), creds) as ch:
            observed["digest"] = trainer_pb2_grpc.TrainerStub(ch).ParametersDigest(
                trainer_pb2.ParametersDigestRequest(), timeout=60
            )
        with open_channel(cluster.child("generator").grpc_address, GrpcConfig(), creds) as ch:
            reply = generator_pb2_grpc.GeneratorStub(ch).Generate(
                generator_pb2.GenerateRequest(
                    prompts=[common_pb2.Prompt(id="fixed", text=FIXED_PROMPT)],
                    sampling=common_pb2.SamplingParams(
                        n=2, temperature=1.0, top_p=1.0, max_tokens=6, seed=1234
                    ),
                ),
                timeout=60,
            )
        observed["served"] = [(list(s.token_ids), list(s.logprobs)) for s in reply.samples]
        observed["served_version"] = reply.policy_version
    finally:
        if intruder is not None:
            intruder.stop()
        cluster.stop(grace=30, controller_first=True)
    observed["samples"] = [
        _comparable(json.loads(line))
        for line in (run_dir / "samples.jsonl").read_text().splitlines()
    ]
    return observed


def test_a_client_without_the_secret_changes_nothing_in_a_real_run(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    undisturbed = _run(tmp_path, "undisturbed", model, attacked=False)
    attacked = _run(tmp_path, "attacked", model, attacked=True)

    intruder: Intruder = attacked["intruder"]
    assert intruder.rounds >= 2, "the intruder did not get to try during the run"
    assert intruder.codes == {
        rpc: {grpc.StatusCode.UNAUTHENTICATED}
        for rpc in ("Register", "Drain", "Train", "ApplyWeights")
    }
    # Only the real pod is registered (its ports differ between the two runs).
    assert [w[:2] for w in attacked["workers"]] == [w[:2] for w in undisturbed["workers"]]
    assert "127.0.0.1:9" not in {w[2] for w in attacked["workers"]}
    # The same run: every step, every sample, the trained and the served weights.
    assert len(undisturbed["steps"]) == STEPS
    for record in ("steps", "samples"):
        differences = _differences(attacked[record], undisturbed[record])
        assert not differences, "\n".join(differences[:20])
    trained = undisturbed["digest"].policy_version
    assert trained >= 1, "no step trained: the weights would compare equal trivially"
    assert attacked["digest"] == undisturbed["digest"]
    assert attacked["served_version"] == undisturbed["served_version"] == trained
    assert attacked["served"] == undisturbed["served"]
