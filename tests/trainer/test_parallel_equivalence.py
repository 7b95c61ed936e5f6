"""FSDP2 over 2 gloo ranks and TP=2 train exactly like 1 rank (up to float reassociation)."""

from __future__ import annotations

import pytest

from tests.trainer.rank_worker import config_env, run_ranks

pytestmark = pytest.mark.slow

# Sums over ranks and shards reassociate float32 additions; nothing else differs.
RTOL, ATOL = 1e-5, 1e-6
PLAN = [["train", 1], ["train", 2], ["train", 3]]
# A narrow token mask, so that masked tokens are counted across ranks too.
MASK = {"off_policy__mask": "token", "off_policy__mask_high": "1.1"}
# Sums of sums and maxima of maxima over the ranks; the update size sums squared shards.
REDUCED = (
    "loss",
    "pg_loss",
    "entropy",
    "ratio_mean",
    "grad_norm",
    "logprob_diff_max",
    "clip_fraction_low",
    "clip_fraction_high",
    "ratio_min",
    "ratio_max",
    "is_weight_mean",
    "is_weight_min",
    "is_weight_max",
    "is_masked_fraction",
    "mismatch_kl",
    "update_ratio",
)


@pytest.fixture(scope="module")
def single_rank(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return run_ranks(1, config_env(str(tiny_model), str(tmp), **MASK), PLAN, tmp / "out.json")


def _assert_same(actual: list[dict], expected: list[dict]) -> None:
    assert len(actual) == len(expected) == len(PLAN)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a["tokens"] == e["tokens"]
        for key in REDUCED:
            assert a[key] == pytest.approx(e[key], rel=RTOL, abs=ATOL), (step, key)
    # The policy moved: the sequence is a real training run, not three equal numbers.
    assert len({round(m["loss"], 6) for m in expected}) == len(PLAN)
    assert all(0 < m["is_masked_fraction"] < 1 and m["update_ratio"] > 0 for m in expected)


def test_fsdp_two_ranks_match_one(tiny_model, tmp_path, single_rank):
    env = config_env(str(tiny_model), str(tmp_path), dp_shard=2, **MASK)
    _assert_same(run_ranks(2, env, PLAN, tmp_path / "out.json"), single_rank)


def test_tp_two_ranks_match_one(tiny_model, tmp_path, single_rank):
    env = config_env(str(tiny_model), str(tmp_path), tp=2, **MASK)
    _assert_same(run_ranks(2, env, PLAN, tmp_path / "out.json"), single_rank)
