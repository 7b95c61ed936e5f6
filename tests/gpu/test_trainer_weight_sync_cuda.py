"""The trainer and the weight sync on CUDA, end to end (docs/architecture.md, docs/cuda.md §2).

Real TrainerEngine ranks (FSDP2 and/or TP over NCCL, bf16 compute, fp32 master weights) train
a Qwen3 with the real 0.6B widths, publish their FSDP2/TP shards in place by CUDA IPC and block
their next optimizer step until acknowledged. This process plays the generator: it applies the
manifests into vLLM's fused layout (``vllm_layout``, the code the vLLM worker extension runs) on
the same GPU, on the other GPU and at TP=2, and checks every element against the trainer's full
tensors after the bf16 cast.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from podrl.v1 import weights_pb2
from podrl.weights import ModelDescription, WeightReceiver, vllm_layout
from tests.gpu.conftest import qwen3_test_config
from tests.gpu.trainer_ranks import TRUSTED_PUBLISHER, run_rank
from tests.trainer.rank_worker import free_port
from tests.weights.reference_layout import expected_vllm_tensors

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ACK_DELAY_SECONDS = 2.0  # the generator holds the ack back; the trainer must wait for it
LAYOUTS = ["1x1", "2x1", "1x2"]  # trainer DP x TP


@dataclass
class Applied:
    generator: str  # e.g. "tp2@cuda:0,1"
    gen_rank: int
    version: int
    version_only: bool
    plan_cached: bool
    tensors: int
    mismatched: list[str]


@dataclass
class TrainerRun:
    layout: str
    world: int
    report: dict
    manifests: dict[int, weights_pb2.WeightManifest] = field(default_factory=dict)
    full: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    applied: list[Applied] = field(default_factory=list)
    ack_times: dict[int, float] = field(default_factory=dict)


def generator_setups() -> dict[str, list[int]]:
    """Generator name -> the CUDA device of each of its TP ranks."""
    setups = {"tp1@cuda:0": [0]}
    if GPUS >= 2:
        setups["tp1@cuda:1"] = [1]
        setups["tp2@cuda:0,1"] = [0, 1]
    return setups


def _wait(path: Path, processes: mp.ProcessContext, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        processes.join(timeout=0.01)  # raises if a rank died
        assert time.monotonic() < deadline, f"{path.name} did not appear"


@pytest.fixture(scope="module", params=LAYOUTS)
def trainer_run(request, qwen3_model_dir: Path, tmp_path_factory) -> TrainerRun:
    layout = request.param
    dp, tp = (int(x) for x in layout.split("x"))
    if dp * tp > GPUS:
        pytest.skip(f"trainer {layout} needs {dp * tp} GPUs, this machine has {GPUS}")
    out = tmp_path_factory.mktemp(f"trainer-{layout}")
    config = qwen3_test_config()
    description = ModelDescription.from_pretrained(qwen3_model_dir)
    processes = mp.start_processes(
        run_rank,
        args=(dp * tp, free_port(), str(qwen3_model_dir), dp, tp, str(out)),
        nprocs=dp * tp,
        join=False,
        start_method="spawn",
    )
    run = TrainerRun(layout=layout, world=dp * tp, report={})
    try:
        receivers: dict[str, list[tuple[WeightReceiver, dict[str, torch.Tensor]]]] = {}
        for name, devices in generator_setups().items():
            receivers[name] = []
            for gen_rank, device in enumerate(devices):
                target = vllm_layout(description, gen_rank, len(devices))
                receiver = WeightReceiver(
                    description, layout=target, trusted_publisher_id=TRUSTED_PUBLISHER
                )
                destinations = {
                    n: torch.zeros(t.shape, dtype=torch.bfloat16, device=f"cuda:{device}")
                    for n, t in target.items()
                }
                receivers[name].append((receiver, destinations))
        for version in (1, 2):
            _wait(out / f"manifest-{version}.bin", processes)
            manifest = weights_pb2.WeightManifest.FromString(
                (out / f"manifest-{version}.bin").read_bytes()
            )
            run.manifests[version] = manifest
            run.full[version] = torch.load(out / f"full-{version}.pt")
            cast = {n: t.to(torch.bfloat16) for n, t in run.full[version].items()}
            for name, ranks in receivers.items():
                for gen_rank, (receiver, destinations) in enumerate(ranks):
                    applied = receiver.apply(manifest, destinations)
                    want = expected_vllm_tensors(cast, config, gen_rank, len(ranks))
                    assert set(want) == set(destinations), name
                    mismatched = [
                        n
                        for n, tensor in destinations.items()
                        if not torch.equal(tensor, want[n].to(tensor.device))
                    ]
                    run.applied.append(
                        Applied(name, gen_rank, version, manifest.version_only,
                                applied.plan_cached, len(destinations), mismatched)
                    )  # fmt: skip
            if version == 1:
                time.sleep(ACK_DELAY_SECONDS)
            run.ack_times[version] = time.time()
            (out / f"ack-{version}").touch()
        _wait(out / "report.json", processes)
        run.report = json.loads((out / "report.json").read_text())
    finally:
        (out / "done").touch()
        while not processes.join(timeout=60):
            pass
    return run


def test_train_step_bf16_compute_fp32_master_weights(trainer_run: TrainerRun) -> None:
    report = trainer_run.report
    assert report["forward_weight_dtypes"] == ["torch.bfloat16"]  # computed in bf16
    assert report["master_dtypes"] == ["torch.float32"]  # parameters, optimizer state
    if trainer_run.layout == "1x1":  # one rank: the plain module (trainer.fsdp auto)
        assert report["placements"] == ["plain"]
    assert report["devices"] == ["cuda:0"]
    assert all(math.isfinite(loss) for loss in report["losses"])
    if trainer_run.layout == "2x1":
        assert any("Shard(dim=0)" in p for p in report["placements"])
    if trainer_run.layout == "1x2":
        assert any("Shard(dim=1)" in p for p in report["placements"])  # rowwise o/down_proj
    # The optimizer stepped: every fp32 master tensor moved between the two versions.
    before, after = trainer_run.full[1], trainer_run.full[2]
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged


def test_manifest_comes_from_every_rank_by_cuda_ipc(trainer_run: TrainerRun) -> None:
    first, second = trainer_run.manifests[1], trainer_run.manifests[2]
    assert not first.version_only and second.version_only
    assert {s.publisher_rank for s in first.shards} == set(range(trainer_run.world))
    assert all(s.storage.WhichOneof("kind") == "cuda_ipc" for s in first.shards)
    assert {s.dtype for s in first.shards} == {first.shards[0].dtype}
    assert first.publisher_id == TRUSTED_PUBLISHER


def test_generator_tensors_equal_trainer_full_tensors_after_cast(trainer_run: TrainerRun) -> None:
    expected = {(name, r, v) for name, devs in generator_setups().items()
                for r in range(len(devs)) for v in (1, 2)}  # fmt: skip
    assert {(a.generator, a.gen_rank, a.version) for a in trainer_run.applied} == expected
    for applied in trainer_run.applied:
        assert applied.mismatched == [], applied
        assert applied.plan_cached == (applied.version == 2), applied
        assert applied.tensors > 0


def test_optimizer_step_waits_for_the_acknowledgement(trainer_run: TrainerRun) -> None:
    report = trainer_run.report
    assert report["pending_before_step"] == [None, 1]
    entered, released = report["hook_entered"][1], report["hook_released"][1]
    ack = trainer_run.ack_times[1]
    assert entered < ack <= released, (entered, ack, released)
