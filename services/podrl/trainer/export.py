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
"""

from __future__ import annotations

import json
import shutil
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


class ExportError(ValueError):
    """A checkpoint or model folder that cannot be exported; the message names the fix."""


def _source_dtype(source: Path) -> torch.dtype:
    config = json.loads((source / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def write_hf_folder(tensors: Mapping[str, torch.Tensor], source: Path, out: Path) -> list[str]:
    """Write ``tensors`` (full, CPU) as safetensors plus ``source``'s other files into ``out``;
    the names of the files in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():
        if old.is_file() and old.name.endswith(_WEIGHT_SUFFIXES):
            old.unlink()  # stale shards of an earlier export must not mix in
    dtype = _source_dtype(source)
    weights = {name: t.detach().to(dtype).contiguous() for name, t in tensors.items()}
    save_torch_state_dict(weights, out, max_shard_size="5GB")
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(item, out / item.name)
    if not (out / GENERATION_CONFIG).is_file():
        from transformers import AutoConfig, GenerationConfig

        GenerationConfig.from_model_config(AutoConfig.from_pretrained(source)).save_pretrained(out)
    return sorted(p.name for p in out.iterdir() if p.is_file())


def export_hf(model: nn.Module, source: Path, out: Path, rank: int) -> list[str]:
    """Collective: every rank calls it; rank 0 writes ``out`` and returns its file names."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    files: list[str] = []
    if rank == 0:
        files = write_hf_folder(full, source, out)
    dist.barrier()
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
) -> list[str]:
    """Offline export of a DCP checkpoint (no process group, one process, CPU): its model
    tensors, read into a plain ``transformers`` model built from ``model_path`` (default: the
    folder the checkpoint's trainer started from), written by :func:`write_hf_folder`.
    ``on_stage`` hears "model", "checkpoint" and "write" as each begins."""
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
    return write_hf_folder(model.state_dict(), source, out)
