"""DCP checkpoints resume exactly, reshard from 2 ranks to 1; the HF export loads in
transformers with the trainer's logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.trainer.rank_worker import config_env, make_request, run_ranks

pytestmark = pytest.mark.slow

KEYS = ("loss", "pg_loss", "entropy", "ratio_mean", "clip_fraction", "grad_norm", "tokens")


def test_resume_equals_uninterrupted_run(tiny_model, tmp_path):
    env = config_env(
        str(tiny_model), str(tmp_path), lr_schedule="cosine", warmup_steps=1, total_steps=5
    )
    ckpt = tmp_path / "ckpt"
    full = run_ranks(
        1,
        env,
        [["train", 1], ["train", 2], ["save", str(ckpt), "data@2"], ["train", 3]],
        tmp_path / "a.json",
    )
    resumed = run_ranks(1, env, [["load", str(ckpt)], ["train", 3]], tmp_path / "b.json")
    assert resumed[0] == {"blob": "data@2", "version": 2}
    # Same process layout, same ops: the resumed step is bit-for-bit the uninterrupted one
    # (model, AdamW moments, scheduler position all restored).
    for key in KEYS:
        assert resumed[1][key] == full[3][key], key
    assert full[3]["loss"] != full[1]["loss"]


@pytest.fixture(scope="module")
def two_rank_run(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    env = config_env(str(tiny_model), str(tmp), dp_shard=2)
    plan = [
        ["train", 1],
        ["train", 2],
        ["save", str(tmp / "ckpt"), "blob-2r"],
        ["train", 3],
        ["export", str(tmp / "export")],
        ["logits", 7, str(tmp / "logits.pt")],
    ]
    return tmp, env, run_ranks(2, env, plan, tmp / "out.json")


def test_checkpoint_saved_at_two_ranks_loads_at_one(tiny_model, two_rank_run, tmp_path):
    tmp, _, results = two_rank_run
    env = config_env(str(tiny_model), str(tmp_path))  # dp_shard = 1
    resumed = run_ranks(1, env, [["load", str(tmp / "ckpt")], ["train", 3]], tmp_path / "o.json")
    assert resumed[0] == {"blob": "blob-2r", "version": 2}
    for key in KEYS:
        assert resumed[1][key] == pytest.approx(results[3][key], rel=1e-5, abs=1e-6), key


def test_export_loads_in_transformers_with_the_trainers_logits(tiny_model, two_rank_run):
    tmp, _, results = two_rank_run
    export = tmp / "export"
    assert "model.safetensors" in results[4] and "tokenizer.json" in results[4]
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(export)
    assert tokenizer("ab").input_ids  # the tokenizer came along
    ids = torch.tensor([make_request(7).sequences[0].prompt_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    trainer_logits = torch.load(tmp / "logits.pt")
    assert (logits - trainer_logits).abs().max().item() <= 1e-6  # measured: 0.0
    # Three optimizer steps changed the weights: the export is the trained policy.
    before = load_file(tiny_model / "model.safetensors")
    after = load_file(export / "model.safetensors")
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
