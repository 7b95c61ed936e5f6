"""The model folder the engine loads: created if it is the project's tiny model, and read for
the parameter names, shapes and dtypes a weight manifest must match."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

log = logging.getLogger(__name__)


class ModelFolderError(ValueError):
    """The model folder is missing or unusable; the message names the config field to fix."""


@dataclass(frozen=True)
class CheckpointTensor:
    """One parameter as the checkpoint (Hugging Face naming) stores it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def ensure_model_folder(path: Path, create_tiny_model_if_missing: bool) -> Path:
    """Return ``path`` once it holds a model; write the tiny Qwen3 there first if allowed.

    The tiny model is written into a temporary sibling folder and renamed into place, so a
    trainer and a generator starting together never read a half-written folder (the loser of
    the rename race uses the winner's identical files).
    """
    if (path / "config.json").is_file():
        return path
    if not create_tiny_model_if_missing:
        raise ModelFolderError(
            f"generator.model_path: {path} has no config.json; point it at a Hugging Face model "
            "folder or set generator.create_tiny_model_if_missing: true"
        )
    from podrl.models.tiny import make_tiny_model  # torch + transformers: import late

    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        make_tiny_model(staging)
        try:
            os.rename(staging, path)
            log.info("wrote the tiny model to %s", path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def checkpoint_tensors(path: Path) -> dict[str, CheckpointTensor]:
    """Names, shapes and dtypes of every tensor in the folder's safetensors files (headers
    only; no tensor data is read)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFolderError(f"generator.model_path: {path} has no *.safetensors files")
    tensors: dict[str, CheckpointTensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                sliced = handle.get_slice(name)
                tensors[name] = CheckpointTensor(
                    shape=tuple(sliced.get_shape()), dtype=_safetensors_dtype(sliced.get_dtype())
                )
    return tensors


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _safetensors_dtype(name: str) -> torch.dtype:
    try:
        return _SAFETENSORS_DTYPES[name]
    except KeyError:
        raise ModelFolderError(f"safetensors dtype {name} is not supported") from None
