"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint folder holds the DCP shards of the model and the optimizer (written by every rank,
loadable at any world size: DCP reshards DTensors on load) plus ``trainer_state.json`` (rank 0):
step, policy version, the LR scheduler's state, torch's RNG states and the controller's opaque
blob (base64).

A folder that looks complete (:func:`is_checkpoint`) is complete: :func:`save` writes into a
hidden sibling (``.<name>.partial``) and renames it into place only once every rank's shards and
the state file are written. Saving over an existing checkpoint moves the old one aside
(``.<name>.replaced``) just before the rename and deletes it after, so ``path`` holds the old
or the new checkpoint, never a mix (an interruption between those two renames leaves ``path``
absent and the old checkpoint complete under the hidden name). :func:`prune` keeps the latest
``keep`` checkpoints the trainer named itself (``step-<8 digits>``).
"""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from podrl.common import faults

if TYPE_CHECKING:
    from podrl.trainer.engine import TrainerEngine

STATE_FILE = "trainer_state.json"
FORMAT = 1
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
# The folders SaveCheckpoint names itself under the checkpoint directory (by trainer step).
STEP_FOLDER = re.compile(r"^step-(\d{8})$")


def step_folder_name(step: int) -> str:
    return f"step-{step:08d}"


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


def _hidden_sibling(path: Path, suffix: str) -> Path:
    return path.with_name(f".{path.name}{suffix}")


def _all_ranks_ok(ok: bool) -> bool:
    """Every rank: True if ``ok`` on every rank (a collective: all ranks must call it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([int(ok)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save(engine: TrainerEngine, path: Path, controller_state: bytes) -> None:
    """Every rank: write its shards into ``.<name>.partial``; rank 0 adds the state file and
    renames the folder to ``path`` (replacing a checkpoint already there). Raises on every rank
    if the save failed on any; ``path`` is then as it was before."""
    partial = _hidden_sibling(path, PARTIAL_SUFFIX)
    rank = engine.env.rank
    error: Exception | None = None
    if rank == 0:
        try:
            if partial.exists():  # left by an interrupted earlier save
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        except OSError as err:
            error = err
    if not _all_ranks_ok(error is None):  # also: nobody writes before the folder is fresh
        raise RuntimeError(f"checkpoint {path}: cannot prepare {partial}: {error}") from error
    model_state, optim_state = get_state_dict(engine.model, engine.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial))
    if rank == 0:
        try:
            faults.hit("trainer.checkpoint_before_state", rank=rank, step=engine.step)
            _write_state(engine, partial, controller_state)
            _replace(partial, path)
        except Exception as err:  # the others must hear of it, not wait in a barrier
            error = err
    if not _all_ranks_ok(error is None):
        raise RuntimeError(
            f"checkpoint {path} was not saved (rank 0: {type(error).__name__}: {error}); "
            "the folder is as it was before"
        ) from error


def _write_state(engine: TrainerEngine, folder: Path, controller_state: bytes) -> None:
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
    (folder / STATE_FILE).write_text(json.dumps(state, indent=1))


def _replace(partial: Path, path: Path) -> None:
    """Rename the complete ``partial`` to ``path``, moving an existing ``path`` out first."""
    if path.exists():
        old = _hidden_sibling(path, REPLACED_SUFFIX)
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
        partial.rename(path)
        shutil.rmtree(old)
    else:
        partial.rename(path)


def prune(directory: Path, keep: int, *, keep_path: Path | None = None) -> list[Path]:
    """Delete all but the ``keep`` latest (highest step) ``step-<8 digits>`` checkpoints in
    ``directory`` (``keep_path`` is never deleted; 0 = keep all), and the hidden leftovers of
    interrupted saves. Rank 0, with no save running. Returns what was deleted."""
    if not directory.is_dir():
        return []
    removed = []
    for leftover in directory.iterdir():
        name = leftover.name
        if name.startswith(".step-") and name.endswith((PARTIAL_SUFFIX, REPLACED_SUFFIX)):
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    if keep <= 0:
        return removed
    steps = sorted(
        (int(match.group(1)), folder)
        for folder in directory.iterdir()
        if folder.is_dir() and (match := STEP_FOLDER.match(folder.name))
    )
    kept = {folder for _, folder in steps[-keep:]}
    if keep_path is not None:
        kept.add(keep_path)
    for _, folder in steps:
        if folder not in kept:
            shutil.rmtree(folder)
            removed.append(folder)
    return removed


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
