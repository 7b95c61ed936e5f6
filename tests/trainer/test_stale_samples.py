"""Samples of a policy several large-lr steps old, trained on by the real engine: the PPO ratio
against their generator clips almost every token and leaves the gradient to a few, while the
decoupled objective with token masking keeps every token's term bounded (docs/algorithms.md,
"Off-policy correction")."""

from __future__ import annotations

import dataclasses
import os

import torch

from podrl.algorithms.losses import BatchTotals, policy_loss, token_weights
from podrl.config import load_config
from podrl.trainer.engine import TrainerEngine
from tests.trainer.engine_logprobs import trainer_logprobs
from tests.trainer.rank_worker import config_env, make_request

SEED, SEQUENCES, MOVES = 100, 8, 3


def _with_generator_logprobs(request, rows: list[list[float]]):
    for seq, row in zip(request.sequences, rows, strict=True):
        del seq.generator_logprobs[:]
        seq.generator_logprobs.extend(row)
    return request


def _padded(rows: list[list[float]]) -> torch.Tensor:
    width = max(len(row) for row in rows)
    return torch.tensor([row + [0.0] * (width - len(row)) for row in rows])


def test_stale_samples_clip_plain_ppo_and_stay_bounded_under_the_decoupled_objective(
    tiny_model, tmp_path
):
    env = config_env(str(tiny_model), str(tmp_path), lr="3e-2")
    engine = TrainerEngine.build(load_config(None, {**os.environ, **env}))
    try:
        stale = make_request(SEED, sequences=SEQUENCES)
        behaviour = trainer_logprobs(engine, stale)  # version 0 sampled them
        for _ in range(MOVES):  # on-policy steps on the same prompts: the policy moves far
            fresh = make_request(SEED, sequences=SEQUENCES, version=engine.policy_version)
            engine.train_step(_with_generator_logprobs(fresh, trainer_logprobs(engine, fresh)))
        now = trainer_logprobs(engine, stale)
        _with_generator_logprobs(stale, behaviour)
        stale.policy_version = engine.policy_version
        plain_settings = engine.loss_settings
        metrics = engine.train_step(stale).metrics  # computed on the weights `now` came from
    finally:
        engine.close()

    mask = _padded([[1.0] * len(row) for row in behaviour])
    advantages = torch.tensor([seq.advantage for seq in stale.sequences])
    totals = BatchTotals(SEQUENCES, int(mask.sum()))
    decoupled_settings = dataclasses.replace(plain_settings, correction="truncate", mask="token")

    def token_gradients(settings):
        logp = _padded(now).requires_grad_()
        terms = policy_loss(logp, _padded(behaviour), advantages, mask, settings, totals)
        terms.loss.backward()
        return terms, logp.grad.abs()

    plain, plain_grad = token_gradients(plain_settings)
    decoupled, decoupled_grad = token_gradients(decoupled_settings)
    n = int(mask.sum())
    # Measured: plain PPO clips 35 of 40 tokens (the engine reports the same), 5 carry the
    # whole gradient and the largest 54 % of it; the decoupled objective clips none, masks the
    # 29 tokens whose weight left [0.5, 5], and 11 kept tokens share it (the largest 26 %).
    assert metrics.clip_fraction == plain.clipped_tokens.item() / n >= 0.75
    assert metrics.is_weight_max > 20 and metrics.mismatch_kl > 1  # far off-policy
    assert decoupled.clipped_tokens.item() == 0
    plain_active = int((plain_grad > 0).sum())
    decoupled_active = int((decoupled_grad > 0).sum())
    assert plain_active <= n // 5 and decoupled_active >= 2 * plain_active
    assert decoupled_active == n - decoupled.masked_tokens.item()
    assert plain_grad.max() / plain_grad.sum() > 0.4
    assert decoupled_grad.max() / decoupled_grad.sum() < 0.3
    # Bounded: a token's gradient is at most is_cap * |A| times its reduction weight.
    bound = decoupled_settings.is_cap * advantages.abs().unsqueeze(-1)
    bound = bound * token_weights(mask, decoupled_settings, totals)
    assert bool((decoupled_grad <= bound + 1e-7).all())
