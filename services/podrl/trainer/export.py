"""Export the policy as a Hugging Face safetensors folder (what vLLM and transformers load).

Two ways in, one writer (:func:`write_hf_folder`):

- :func:`export_hf` (the trainer's ``ExportHF`` RPC, which the controller calls when a run
  finishes): the sharded parameters are gathered to full tensors on rank 0 (CPU);
- :func:`export_checkpoint` (``podrl export RUN_DIR OUT``, offline, no trainer running): the
  model tensors of a DCP checkpoint are read into a plain model of the same architecture.

The writer casts to the source model's dtype and writes with
``huggingface_hub.save_torch_state_dict`` (sharded files plus an index above 5 GB; tied weights
written once). Every other file of the source folder (config.json, tokenizer, generation config,
chat template) is copied unchanged: the architecture is the same. A source without a
generation_config.json gets one made from its config.

An export never deletes a file podrl did not write. It writes into a fresh hidden folder beside
the target, then moves the files it produced into the target one by one (each ``os.replace``)
and records their names in ``.podrl-export.json`` there. A later export into the same folder
replaces those files and deletes the ones it no longer writes (a stale shard must not be loaded
with the new ones). A target holding any other file is refused (:class:`ExportError`) unless the
caller passes ``overwrite``: then the other files stay as they are, and only files of the names
the export writes are replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import save_torch_state_dict
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from podrl.trainer.checkpoint import STATE_FILE, is_checkpoint

_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt")
GENERATION_CONFIG = "generation_config.json"
#: The names of the files an export wrote into its folder (the only ones a later export deletes).
EXPORT_RECORD = ".podrl-export.json"


class ExportError(ValueError):
    """A checkpoint or model folder that cannot be exported; the message names the fix."""


def _source_dtype(source: Path) -> torch.dtype:
    config = json.loads((source / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _recorded(out: Path) -> set[str]:
    """The files an earlier podrl export wrote into ``out`` (plain names only)."""
    try:
        names = json.loads((out / EXPORT_RECORD).read_text()).get("files", [])
    except (OSError, ValueError, AttributeError):
        return set()
    return {n for n in names if isinstance(n, str) and n not in ("", ".", "..") and "/" not in n}


def foreign_entries(out: Path) -> list[str]:
    """The entries of folder ``out`` that no podrl export wrote (none when it is absent)."""
    if not out.is_dir():
        return []
    recorded = _recorded(out) | {EXPORT_RECORD}
    return sorted(p.name for p in out.iterdir() if p.name not in recorded)


def write_hf_folder(
    tensors: Mapping[str, torch.Tensor], source: Path, out: Path, *, overwrite: bool = False
) -> list[str]:
    """Write ``tensors`` (full, CPU) as safetensors plus ``source``'s other files into ``out``
    without deleting any file podrl did not write (module docstring); the names of the files
    written. ExportError when ``out`` is not a folder, or holds files no podrl export wrote and
    ``overwrite`` is False."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file, not a folder; name a folder to export into")
    foreign = foreign_entries(out)
    if foreign and not overwrite:
        raise ExportError(
            f"{out} holds files a podrl export did not write ({', '.join(foreign[:5])}"
            f"{', ...' if len(foreign) > 5 else ''}); export into an empty or new folder "
            "(podrl export: or pass --overwrite, which keeps them)"
        )
    # The staging folder must share the target's filesystem (os.replace), also through a link.
    out = Path(os.path.realpath(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".export", dir=out.parent))
    try:
        dtype = _source_dtype(source)
        weights = {name: t.detach().to(dtype).contiguous() for name, t in tensors.items()}
        save_torch_state_dict(weights, staging, max_shard_size="5GB")
        for item in source.iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(item, staging / item.name)
        if not (staging / GENERATION_CONFIG).is_file():
            from transformers import AutoConfig, GenerationConfig

            config = AutoConfig.from_pretrained(source)
            GenerationConfig.from_model_config(config).save_pretrained(staging)
        written = sorted(p.name for p in staging.iterdir() if p.is_file())
        out.mkdir(exist_ok=True)
        stale = _recorded(out) - set(written)
        for name in written:
            os.replace(staging / name, out / name)
        for name in stale:  # files an earlier export wrote and this one does not
            (out / name).unlink(missing_ok=True)
        record = staging / EXPORT_RECORD
        record.write_text(json.dumps({"files": written}, indent=1))
        os.replace(record, out / EXPORT_RECORD)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def export_hf(model: nn.Module, source: Path, out: Path, rank: int) -> list[str]:
    """Collective: every rank calls it; rank 0 writes ``out`` and returns its file names."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    files: list[str] = []
    error: Exception | None = None
    if rank == 0:
        try:
            files = write_hf_folder(full, source, out)
        except Exception as err:  # the other ranks must not wait in the barrier for rank 0
            error = err
    dist.barrier()
    if error is not None:
        raise error
    return files


def checkpoint_model_path(checkpoint: Path) -> Path:
    """The model folder the checkpoint's trainer started from (its ``trainer_state.json``)."""
    state_file = checkpoint / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ExportError(
            f"{checkpoint} is not a podrl checkpoint: cannot read {state_file} ({err})"
        ) from None
    return Path(state["model_path"])


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    model_path: Path | None = None,
    on_stage: Callable[[str], None] = lambda stage: None,
    *,
    overwrite: bool = False,
) -> list[str]:
    """Offline export of a DCP checkpoint (no process group, one process, CPU): its model
    tensors, read into a plain ``transformers`` model built from ``model_path`` (default: the
    folder the checkpoint's trainer started from), written by :func:`write_hf_folder`.
    ``on_stage`` hears "model", "checkpoint" and "write" as each begins; ``overwrite`` as in
    :func:`write_hf_folder`."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig, AutoModelForCausalLM

    if not is_checkpoint(checkpoint):
        raise ExportError(
            f"{checkpoint} is not a complete podrl checkpoint (it needs .metadata and "
            "trainer_state.json); pick one under <run_dir>/checkpoints"
        )
    source = model_path or checkpoint_model_path(checkpoint)
    if not (source / "config.json").is_file():
        raise ExportError(
            f"model folder {source} (the trainer's starting model) has no config.json; pass the "
            "folder the run started from with --model"
        )
    on_stage("model")
    # The trainer keeps fp32 master weights: read them at full precision, cast when writing.
    config = AutoConfig.from_pretrained(source)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    on_stage("checkpoint")
    state = {"model": model.state_dict()}
    try:
        dcp.load(state, checkpoint_id=str(checkpoint))
    except Exception as err:  # DCP reports a key or shape mismatch as a bare RuntimeError
        raise ExportError(
            f"{checkpoint}: its model tensors do not fit {source} ({type(err).__name__}: {err}); "
            "pass the model folder the run started from with --model"
        ) from err
    model.load_state_dict(state["model"])
    on_stage("write")
    return write_hf_folder(model.state_dict(), source, out, overwrite=overwrite)
