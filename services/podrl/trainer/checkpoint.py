"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint folder holds the DCP shards of the model and the optimizer (written by every rank,
loadable at any world size: DCP reshards DTensors on load) plus ``trainer_state.json`` (rank 0):
step, policy version, the LR scheduler's state, torch's RNG states and the controller's opaque
blob (base64).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

if TYPE_CHECKING:
    from podrl.trainer.engine import TrainerEngine

STATE_FILE = "trainer_state.json"
FORMAT = 1


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


def _rng_bytes(state: torch.Tensor) -> str:
    return _b64(state.cpu().numpy().tobytes())


def _rng_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(_unb64(text)), dtype=torch.uint8).clone()


def is_checkpoint(path: Path) -> bool:
    return (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def save(engine: TrainerEngine, path: Path, controller_state: bytes) -> None:
    """Every rank: write its shards; rank 0 writes the small state file last (its presence marks
    a complete checkpoint)."""
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))
    if engine.env.rank == 0:
        state = {
            "format": FORMAT,
            "step": engine.step,
            "policy_version": engine.policy_version,
            "world_size": engine.env.world_size,
            "model_path": str(engine.model_path),
            "scheduler": engine.scheduler.state_dict(),
            "rng_cpu": _rng_bytes(torch.get_rng_state()),
            "rng_cuda": [_rng_bytes(s) for s in torch.cuda.get_rng_state_all()]
            if engine.device.type == "cuda"
            else [],
            "controller_state": _b64(controller_state),
        }
        tmp = path / f"{STATE_FILE}.tmp"
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(path / STATE_FILE)
    dist.barrier()


def load(engine: TrainerEngine, path: Path) -> bytes:
    """Every rank: restore model, optimizer, scheduler, counters and RNG from ``path``."""
    state = json.loads((path / STATE_FILE).read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')} is not {FORMAT}")
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    shards = {"model": model_state, "optim": optim_state}
    dcp.load(shards, checkpoint_id=str(path))
    set_state_dict(
        engine.model,
        engine.optimizer,
        model_state_dict=shards["model"],
        optim_state_dict=shards["optim"],
    )
    engine.scheduler.load_state_dict(state["scheduler"])
    engine.step = int(state["step"])
    engine.policy_version = int(state["policy_version"])
    torch.set_rng_state(_rng_tensor(state["rng_cpu"]))
    if engine.device.type == "cuda" and state["rng_cuda"]:
        states = [_rng_tensor(s) for s in state["rng_cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    return _unb64(state["controller_state"])
