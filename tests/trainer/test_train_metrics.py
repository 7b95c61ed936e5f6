"""The step's TrainMetrics on the tiny model in one process, against values computed here
from the model's own logits (docs/trainer.md, "Metrics of a step")."""

from __future__ import annotations

import math
import os

import pytest
import torch

from podrl.config import load_config
from podrl.config.loop import DriftWarningsConfig
from podrl.trainer.engine import TrainerEngine
from tests.trainer.engine_logprobs import trainer_logprobs
from tests.trainer.rank_worker import config_env, make_request


def _engine(tiny_model, tmp_path, **trainer: object) -> TrainerEngine:
    env = config_env(str(tiny_model), str(tmp_path), **trainer)
    return TrainerEngine.build(load_config(None, {**os.environ, **env}))


def test_off_policy_metrics_match_the_model_logits(tiny_model, tmp_path):
    engine = _engine(
        tiny_model,
        tmp_path,
        off_policy__mask="token",
        off_policy__mask_low=0.8,
        off_policy__mask_high=1.25,
    )
    try:
        request = make_request(7, sequences=6)
        logps = trainer_logprobs(engine, request)
        weights, signs = [], []
        for seq, logp in zip(request.sequences, logps, strict=True):
            for mine, theirs in zip(logp, seq.generator_logprobs, strict=True):
                weights.append(math.exp(mine - theirs))
                signs.append(seq.advantage)
        n = len(weights)
        metrics = engine.train_step(request).metrics
    finally:
        engine.close()
    approx = lambda value: pytest.approx(value, rel=1e-4, abs=1e-6)  # noqa: E731
    assert metrics.tokens == n
    assert metrics.is_weight_mean == approx(sum(weights) / n)
    assert metrics.is_weight_min == approx(min(weights))
    assert metrics.is_weight_max == approx(max(weights))
    assert metrics.mismatch_kl == approx(sum(w - math.log(w) - 1 for w in weights) / n)
    outside = [w < 0.8 or w > 1.25 for w in weights]
    assert 0 < sum(outside) < n  # the band cuts some tokens and keeps some
    assert metrics.is_masked_fraction == approx(sum(outside) / n)
    assert metrics.is_truncated_fraction == 0.0  # correction none (sync mode's default)
    # correction none: the PPO ratio is w itself; eps 0.2 / 0.2, dual clip c = 3.
    high = sum(a > 0 and w > 1.2 for w, a in zip(weights, signs, strict=True))
    low = sum(a < 0 and w < 0.8 for w, a in zip(weights, signs, strict=True))
    dual = sum(a < 0 and w > 3.0 for w, a in zip(weights, signs, strict=True))
    assert metrics.clip_fraction_high == approx(high / n)
    assert metrics.clip_fraction_low == approx(low / n)
    assert metrics.clip_fraction_dual == approx(dual / n)
    assert metrics.clip_fraction == approx((high + low + dual) / n)
    assert (metrics.ratio_min, metrics.ratio_max) == (approx(min(weights)), approx(max(weights)))


def _full_parameters(engine: TrainerEngine) -> torch.Tensor:
    return torch.cat(
        [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().flatten()
            for p in engine.model.parameters()
        ]
    )


def test_update_ratio_is_the_relative_step_and_zero_for_lr_zero(tiny_model, tmp_path):
    # Linear decay to 0 over one step: step 1 trains at lr 1e-3, step 2 at lr 0.
    engine = _engine(tiny_model, tmp_path, lr_schedule="linear", total_steps=1)
    try:
        before = _full_parameters(engine)
        first = engine.train_step(make_request(1)).metrics
        after = _full_parameters(engine)
        second = engine.train_step(make_request(2, version=1)).metrics
        unchanged = _full_parameters(engine)
    finally:
        engine.close()
    assert first.learning_rate == pytest.approx(1e-3)
    expected = ((after - before).norm() / after.norm()).item()
    assert expected > 0
    assert first.update_ratio == pytest.approx(expected, rel=1e-4)
    assert second.learning_rate == 0.0
    assert torch.equal(unchanged, after)
    assert second.update_ratio == 0.0


def test_the_drift_band_holds_the_default_lr_and_flags_a_thousandfold_one(tiny_model, tmp_path):
    """loop.drift_warnings' update band (docs/algorithms.md, "When RL drifts"): AdamW's first
    step moves every element by about lr, so update_ratio grows with lr; the default lr's step
    lies inside the band, a step at 1000 times it above."""
    band = DriftWarningsConfig()
    ratios = {}
    for lr in (1e-6, 1e-3):
        engine = _engine(tiny_model, tmp_path / f"lr-{lr:g}", lr=lr)
        try:
            ratios[lr] = engine.train_step(make_request(1)).metrics.update_ratio
        finally:
            engine.close()
    assert band.update_ratio_min < ratios[1e-6] < band.update_ratio_max < ratios[1e-3]
    assert ratios[1e-3] / ratios[1e-6] == pytest.approx(1000, rel=0.01)
