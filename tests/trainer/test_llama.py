"""A Llama causal LM goes through the same stack: TP=2 trains like 1 rank."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.trainer.rank_worker import config_env, run_ranks

pytestmark = pytest.mark.slow


def test_llama_tp_two_ranks_match_one(tmp_path):
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    plan = [["train", 1], ["train", 2]]
    one = run_ranks(1, config_env(str(tmp_path / "llama"), str(tmp_path)), plan, tmp_path / "a")
    env = config_env(str(tmp_path / "llama"), str(tmp_path), tp=2)
    two = run_ranks(2, env, plan, tmp_path / "b")
    for a, b in zip(one, two, strict=True):
        for key in ("loss", "entropy", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), key
    assert one[0]["loss"] != one[1]["loss"]
