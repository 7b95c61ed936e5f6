"""Trainer ranks on CUDA for the GPU tests: the real TrainerEngine (FSDP2 x TP over NCCL, bf16
compute, fp32 master weights) and the real weight-publishing commands.

Protocol per rank (files under ``out``), for versions 1 and 2:

1. a GRPO ``train_step`` (the second one blocks in the optimizer pre-step hook until the
   generator acknowledged version 1 by writing ``ack-1``);
2. ``WeightPublishing.publish`` (every rank its own shards, rank 0 assembles the manifest);
3. every parameter's full tensor (DTensor ``full_tensor``; a one-rank trainer's parameters are
   plain tensors) for the test to compare against;
   rank 0 writes ``full-<v>.pt`` and then ``manifest-<v>.bin``.

Rank 0 writes ``report.json`` (losses, dtypes seen in forward, hook timings) and every rank
stays alive (its GPU memory mapped by the test) until ``done`` appears.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import torch

from tests.file_handshake import wait_for, write_atomic

TRUSTED_PUBLISHER = "trainer-gpu-test"


def run_rank(rank: int, world: int, port: int, model_dir: str, dp: int, tp: int, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    from podrl.config import load_config
    from podrl.trainer.engine import TrainerEngine
    from podrl.trainer.servicer import WeightPublishing
    from podrl.v1 import trainer_pb2
    from tests.trainer.rank_worker import make_request

    out_dir = Path(out)
    config = load_config(
        None,
        {
            "PODRL_DEVICE": "cuda",
            "PODRL_WORKER_ID": TRUSTED_PUBLISHER,
            "PODRL_RUN_DIR": str(out_dir / "run"),
            "PODRL_TRAINER__MODEL_PATH": model_dir,
            "PODRL_TRAINER__DP_SHARD": str(dp),
            "PODRL_TRAINER__TP": str(tp),
            "PODRL_TRAINER__MICRO_BATCH_SIZE": "2",
            "PODRL_TRAINER__LR": "1e-3",
        },
    )
    engine = TrainerEngine.build(config)
    events: dict[str, list[float]] = {"hook_entered": [], "hook_released": []}
    # Registered before and after the weight sync's own pre-step hook: brackets its wait.
    engine.optimizer.register_step_pre_hook(lambda *_: events["hook_entered"].append(time.time()))
    sync = WeightPublishing(
        engine,
        rank=rank,
        publisher_id=config.worker_id,
        ack_timeout=config.trainer.weights_ack_timeout_seconds,
    )
    engine.optimizer.register_step_pre_hook(lambda *_: events["hook_released"].append(time.time()))
    forward_dtypes: list[str] = []
    q_proj = engine.model.model.layers[0].self_attn.q_proj
    # The dtype the projection computed in: FSDP2's bf16 parameters, or bf16 autocast over the
    # fp32 weights of a one-rank trainer's plain module.
    q_proj.register_forward_hook(lambda _m, _i, out: forward_dtypes.append(str(out.dtype)))

    stop = threading.Event()

    def acknowledge_when_told() -> None:  # the AcknowledgeWeights RPC, as a file
        acked = 0
        while not stop.is_set():
            if (out_dir / f"ack-{acked + 1}").exists():
                acked += 1
                sync.publisher.finish(acked)
            time.sleep(0.005)

    listener = threading.Thread(target=acknowledge_when_told, daemon=True)
    listener.start()
    losses, pending_before_step = [], []
    try:
        for version in (1, 2):
            pending_before_step.append(sync.publisher.pending_version)
            request = make_request(version, sequences=8, version=engine.policy_version)
            losses.append(engine.train_step(request).metrics.loss)
            assert engine.policy_version == version
            reply = sync.publish(trainer_pb2.PublishWeightsRequest().SerializeToString())
            full = {
                name: (param.full_tensor() if hasattr(param, "full_tensor") else param)
                .detach()
                .cpu()
                for name, param in engine.model.named_parameters()
            }
            if rank == 0:
                torch.save(full, out_dir / f"full-{version}.pt")
                manifest = trainer_pb2.PublishWeightsResponse.FromString(reply).manifest
                write_atomic(out_dir / f"manifest-{version}.bin", manifest.SerializeToString())
        master = {str(p.dtype) for p in engine.model.parameters()}
        placements = sorted(
            {str(getattr(p, "placements", "plain")) for p in engine.model.parameters()}
        )
        if rank == 0:
            report = {
                "losses": losses,
                "forward_weight_dtypes": sorted(set(forward_dtypes)),
                "master_dtypes": sorted(master),
                "placements": placements,
                "devices": sorted({str(p.device) for p in engine.model.parameters()}),
                "pending_before_step": pending_before_step,
                **events,
            }
            write_atomic(out_dir / "report.json", json.dumps(report).encode())
        wait_for(out_dir / "done", timeout=600)
    finally:
        stop.set()
        sync.publisher.close()
        engine.close()
