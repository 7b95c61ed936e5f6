"""Export the policy as a Hugging Face safetensors folder (what vLLM and transformers load).

The sharded parameters are gathered to full tensors on rank 0 (CPU), cast to the source model's
dtype and written with ``huggingface_hub.save_torch_state_dict`` (sharded files plus an index
above 5 GB; tied weights written once). Every other file of the source folder (config.json,
tokenizer, generation config, chat template) is copied unchanged: the architecture is the same.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from huggingface_hub import save_torch_state_dict
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt")


def _source_dtype(source: Path) -> torch.dtype:
    config = json.loads((source / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def export_hf(model: nn.Module, source: Path, out: Path, rank: int) -> list[str]:
    """Collective: every rank calls it; rank 0 writes ``out`` and returns its file names."""
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    files: list[str] = []
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for old in out.iterdir():
            if old.is_file() and old.name.endswith(_WEIGHT_SUFFIXES):
                old.unlink()  # stale shards of an earlier export must not mix in
        dtype = _source_dtype(source)
        tensors = {name: t.detach().to(dtype).contiguous() for name, t in full.items()}
        save_torch_state_dict(tensors, out, max_shard_size="5GB")
        for item in source.iterdir():
            if item.is_file() and not item.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(item, out / item.name)
        files = sorted(p.name for p in out.iterdir() if p.is_file())
    dist.barrier()
    return files
