"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is the trainer's state dict ``{model, optim, train_state}``
(``TrainerEngine.state_dict``, the same dict a healing pod receives): a folder holds the DCP
shards of the model and the optimizer (written by every rank, loadable at any world size: DCP
reshards DTensors on load) plus ``trainer_state.json`` (rank 0): the train state (policy
version, the LR scheduler's state, torch's RNG states: ``podrl.trainer.engine``'s
``TrainState``), the model folder the trainer started from and the controller's opaque blob
(base64).

Format 2 nests the train state under ``train_state``; format 1 (before the trainer kept one
counter) held the same keys at the top level beside a ``step`` equal to ``policy_version``, and
still loads.

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
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from podrl.common import faults
from podrl.trainer.errors import CheckpointNoSpaceError, CheckpointSaveError

STATE_FILE = "trainer_state.json"
FORMAT = 2
# Format 1 held the train state's keys at the top level (and a step equal to the version).
_FORMATS = (1, FORMAT)
PARTIAL_SUFFIX = ".partial"
REPLACED_SUFFIX = ".replaced"
# The folders SaveCheckpoint names itself under the checkpoint directory (by policy version).
STEP_FOLDER = re.compile(r"^step-(\d{8})$")


class Stateful(Protocol):
    """What a checkpoint saves and restores: the trainer's ``state_dict`` (``model`` and
    ``optim`` as ``get_state_dict`` returns them, ``train_state`` JSON-ready)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def step_folder_name(version: int) -> str:
    return f"step-{version:08d}"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text.encode("ascii"))


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


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _causes(err: BaseException) -> list[BaseException]:
    """``err``, its causes and contexts, and the rank failures a DCP exception carries."""
    seen: list[BaseException] = []
    todo = [err]
    while todo:
        item = todo.pop()
        if item is None or any(item is s for s in seen):
            continue
        seen.append(item)
        todo += [item.__cause__, item.__context__]
        if isinstance(item, CheckpointException):
            todo += [failure[0] for failure in item.failures.values()]
    return seen


def _free_bytes(folder: Path) -> int:
    try:
        stats = os.statvfs(folder)
    except OSError:
        return -1
    return stats.f_bavail * stats.f_frsize


def _local_bytes(state: object) -> int:
    """Bytes of this rank's tensors in a state dict (its share of the checkpoint)."""
    leaves, _ = tree_flatten(state)
    total = 0
    for leaf in leaves:
        if isinstance(leaf, DTensor):
            leaf = leaf.to_local()
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
    return total


def _save_failure(err: BaseException, partial: Path, needed: int) -> CheckpointSaveError:
    """The error this rank reports: the first OSError among ``err``'s causes (DCP's writer also
    reports a full disk as a short write, "unexpected pos"), classified as no space when its
    errno says so or when the filesystem has less room left than this rank's shards need."""
    causes = _causes(err)
    os_error = next((c for c in causes if isinstance(c, OSError) and c.errno), None)
    free = _free_bytes(partial.parent)
    if os_error is not None and os_error.errno in _NO_SPACE:
        return CheckpointNoSpaceError(str(os_error)[:500])
    if os_error is None and 0 <= free < needed:
        return CheckpointNoSpaceError(
            f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: {free} bytes free under "
            f"{partial.parent}, this rank's shards need {needed} "
            f"({type(err).__name__}: {_first_line(err)})"
        )
    if os_error is not None:
        return CheckpointSaveError(str(os_error)[:500])
    return CheckpointSaveError(f"{type(err).__name__}: {_first_line(err)}")


def _first_line(err: BaseException) -> str:
    """A short form of ``err`` (DCP's exceptions carry every rank's traceback)."""
    innermost = [c for c in _causes(err) if not isinstance(c, CheckpointException)]
    shown = innermost[-1] if innermost else err
    text = str(shown).strip().splitlines()
    return (text[-1] if text else type(shown).__name__)[:300]


def save(
    trainer: Stateful,
    path: Path,
    *,
    rank: int,
    world_size: int,
    model_path: Path,
    controller_state: bytes,
) -> None:
    """Every rank: write its shards into ``.<name>.partial``; rank 0 adds the state file and
    renames the folder to ``path`` (replacing a checkpoint already there). If the save fails on
    any rank (a full disk included), every rank raises CheckpointSaveError (no space:
    CheckpointNoSpaceError), ``path`` is as it was before and the partial folder is removed:
    the ranks agree on the outcome, so none is left waiting in a collective of the save."""
    partial = _hidden_sibling(path, PARTIAL_SUFFIX)
    error: BaseException | None = None
    if rank == 0:
        try:
            if partial.exists():  # left by an interrupted earlier save
                shutil.rmtree(partial)
            partial.mkdir(parents=True)
        except OSError as err:
            error = err
    if not _all_ranks_ok(error is None):  # also: nobody writes before the folder is fresh
        raise _failed(path, partial, rank, error, 0, "cannot prepare the folder")
    state = trainer.state_dict()
    shards = {"model": state["model"], "optim": state["optim"]}
    version = state["train_state"]["policy_version"]
    # Every rank writes about as much as this one: refuse before writing when it cannot fit.
    needed = _local_bytes(shards)
    free = _free_bytes(partial)
    if 0 <= free < needed * world_size:
        error = OSError(
            errno.ENOSPC,
            f"{os.strerror(errno.ENOSPC)}: {free} bytes free under {partial.parent}, the "
            f"checkpoint needs about {needed * world_size}",
        )
    else:
        try:
            if faults.ARMED:
                faults.hit("trainer.checkpoint_before_write", rank=rank, version=version)
        except Exception as err:
            error = err
    # DCP's collectives need every rank: a rank that cannot write says so first.
    if _all_ranks_ok(error is None):
        try:
            dcp.save(shards, checkpoint_id=str(partial))
        except (Exception, CheckpointException) as err:  # DCP's is a BaseException
            error = err
    if _all_ranks_ok(error is None) and rank == 0:
        train_state = state["train_state"]
        try:
            if faults.ARMED:
                faults.hit("trainer.checkpoint_before_state", rank=rank, version=version)
            saved = {
                "format": FORMAT,
                "world_size": world_size,
                "model_path": str(model_path),
                "train_state": train_state,
                "controller_state": _b64(controller_state),
            }
            (partial / STATE_FILE).write_text(json.dumps(saved, indent=1))
            _replace(partial, path)
        except Exception as err:  # the others must hear of it, not wait in a barrier
            error = err
    if not _all_ranks_ok(error is None):
        raise _failed(path, partial, rank, error, needed, "was not saved")


def _failed(
    path: Path, partial: Path, rank: int, error: BaseException | None, needed: int, what: str
) -> CheckpointSaveError:
    """Every rank, once all know the save failed: rank 0 removes the partial folder; the
    error this rank raises (this rank's own failure, or that another rank failed)."""
    failure = _save_failure(error, partial, needed) if error is not None else None
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
    kind = type(failure) if failure is not None else CheckpointSaveError
    detail = str(failure) if failure is not None else "another rank failed"
    return kind(f"checkpoint {path} {what} (rank {rank}: {detail}); the folder is as it was before")


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


def load(trainer: Stateful, path: Path) -> bytes:
    """Every rank: restore the trainer's state saved at ``path``; the controller's blob."""
    saved = json.loads((path / STATE_FILE).read_text())
    if saved.get("format") not in _FORMATS:
        raise ValueError(
            f"{path}: checkpoint format {saved.get('format')} is not one of {list(_FORMATS)}"
        )
    state = trainer.state_dict()
    shards = {"model": state["model"], "optim": state["optim"]}
    try:
        dcp.load(shards, checkpoint_id=str(path))
    except CheckpointException as err:  # a BaseException: it would end the rank's command loop
        raise RuntimeError(f"checkpoint {path} cannot be read: {_first_line(err)}") from err
    train_state = saved if saved["format"] == 1 else saved["train_state"]
    trainer.load_state_dict({**shards, "train_state": train_state})
    return _unb64(saved["controller_state"])
