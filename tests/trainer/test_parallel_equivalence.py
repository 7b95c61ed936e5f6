"""FSDP2 over 2 gloo ranks and TP=2 train exactly like 1 rank (up to float reassociation)."""

from __future__ import annotations

import pytest

from tests.trainer.rank_worker import config_env, run_ranks

pytestmark = pytest.mark.slow

# Sums over ranks and shards reassociate float32 additions; nothing else differs.
RTOL, ATOL = 1e-5, 1e-6
PLAN = [["train", 1], ["train", 2], ["train", 3]]


@pytest.fixture(scope="module")
def single_rank(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return run_ranks(1, config_env(str(tiny_model), str(tmp)), PLAN, tmp / "out.json")


def _assert_same(actual: list[dict], expected: list[dict]) -> None:
    assert len(actual) == len(expected) == len(PLAN)
    for step, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a["tokens"] == e["tokens"]
        for key in ("loss", "pg_loss", "entropy", "ratio_mean", "grad_norm", "logprob_diff_max"):
            assert a[key] == pytest.approx(e[key], rel=RTOL, abs=ATOL), (step, key)
    # The policy moved: the sequence is a real training run, not three equal numbers.
    assert len({round(m["loss"], 6) for m in expected}) == len(PLAN)


def test_fsdp_two_ranks_match_one(tiny_model, tmp_path, single_rank):
    env = config_env(str(tiny_model), str(tmp_path), dp_shard=2)
    _assert_same(run_ranks(2, env, PLAN, tmp_path / "out.json"), single_rank)


def test_tp_two_ranks_match_one(tiny_model, tmp_path, single_rank):
    env = config_env(str(tiny_model), str(tmp_path), tp=2)
    _assert_same(run_ranks(2, env, PLAN, tmp_path / "out.json"), single_rank)
