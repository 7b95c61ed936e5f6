"""The small Qwen3 the weight tests shard: same seed -> same weights in every process."""

from __future__ import annotations

import torch

CONFIG = dict(
    architectures=["Qwen3ForCausalLM"],
    vocab_size=120,  # not a multiple of 64: exercises vLLM vocab padding
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)


def make_model(seed: int = 0) -> torch.nn.Module:
    # transformers is imported here so that processes needing only CONFIG start fast.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(Qwen3Config(**CONFIG))


def full_params(seed: int = 0) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in make_model(seed).named_parameters()}
