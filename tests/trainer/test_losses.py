"""Each loss mode against values worked out by hand from the formulas in docs/algorithms.md."""

from __future__ import annotations

import math

import pytest
import torch

from podrl.algorithms.losses import BatchTotals, LossSettings, k3_kl, policy_loss

# Two sequences, three token slots; slot 2 of sequence 0 is padding (mask 0).
RATIOS = [[1.5, 0.7, 1.0], [0.5, 1.3, 1.0]]
LOGP = [[-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0]]
MASK = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
ADV = [1.0, -2.0]
TOTALS = BatchTotals(num_sequences=2, num_tokens=5)
# With eps_low = 0.2, eps_high = 0.28, per token -min(r A, clip(r, 0.8, 1.28) A):
#   seq 0 (A = +1): r=1.5 → clipped to 1.28 → -1.28;  r=0.7 → -0.7 (below 0.8 but A>0: unclipped)
#   seq 1 (A = -2): r=0.5 → clipped to 0.8 → +1.6;  r=1.3 → +2.6 (A<0: high side unclipped);
#                   r=1.0 → +2.0
PG = [[-1.28, -0.7, 0.0], [1.6, 2.6, 2.0]]
CLIPPED = 2  # seq 0 token 0 and seq 1 token 0


def _inputs():
    logp = torch.tensor(LOGP, requires_grad=True)
    generator = torch.tensor(LOGP) - torch.log(torch.tensor(RATIOS))
    # Garbage in the padding slot must not matter.
    generator[0, 2] = -1e9
    return logp, generator, torch.tensor(ADV), torch.tensor(MASK)


def _settings(mode: str, **kw) -> LossSettings:
    return LossSettings(mode=mode, clip_eps_low=0.2, clip_eps_high=0.28, **kw)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # mean over sequences of per-sequence token means
        ("grpo", ((-1.28 - 0.7) / 2 + (1.6 + 2.6 + 2.0) / 3) / 2),
        # token-level mean over all 5 completion tokens
        ("dapo", (-1.28 - 0.7 + 1.6 + 2.6 + 2.0) / 5),
        # token sum over B * L_max = 2 * 4
        ("dr_grpo", (-1.28 - 0.7 + 1.6 + 2.6 + 2.0) / (2 * 4)),
    ],
)
def test_loss_modes_match_hand_computed(mode, expected):
    logp, generator, adv, mask = _inputs()
    terms = policy_loss(logp, generator, adv, mask, _settings(mode, dr_grpo_max_tokens=4), TOTALS)
    assert terms.loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.pg_loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.kl.item() == 0.0
    assert terms.clipped_tokens.item() == CLIPPED
    assert terms.tokens.item() == 5
    assert terms.ratio_sum.item() == pytest.approx(1.5 + 0.7 + 0.5 + 1.3 + 1.0, abs=1e-6)


def test_gradient_is_zero_on_clipped_and_masked_tokens():
    logp, generator, adv, mask = _inputs()
    policy_loss(logp, generator, adv, mask, _settings("dapo"), TOTALS).loss.backward()
    # d/dlogp of -r*A/N is -A*r/N on unclipped tokens; clipped and padding tokens get 0.
    expected = [[0.0, -1.0 * 0.7 / 5, 0.0], [0.0, 2.0 * 1.3 / 5, 2.0 * 1.0 / 5]]
    assert torch.allclose(logp.grad, torch.tensor(expected), atol=1e-6)


def test_symmetric_clip_changes_which_tokens_clip():
    logp, generator, adv, mask = _inputs()
    settings = LossSettings(mode="dapo", clip_eps_low=0.2, clip_eps_high=0.2)
    terms = policy_loss(logp, generator, adv, mask, settings, TOTALS)
    # seq 1 token 1 (r=1.3, A<0) is still unclipped; seq 0 token 0 clips at 1.2 instead of 1.28.
    assert terms.loss.item() == pytest.approx((-1.2 - 0.7 + 1.6 + 2.6 + 2.0) / 5, abs=1e-6)


def test_k3_kl_penalty():
    logp, generator, adv, mask = _inputs()
    delta = [[0.5, -0.5, 9.0], [0.0, 1.0, -1.0]]  # ref - logp; the padding slot is ignored
    ref = torch.tensor(LOGP) + torch.tensor(delta)
    k3 = [math.exp(d) - d - 1 for d in (0.5, -0.5, 0.0, 1.0, -1.0)]
    terms = policy_loss(logp, generator, adv, mask, _settings("dapo", kl_coef=0.1), TOTALS, ref)
    pg = (-1.28 - 0.7 + 1.6 + 2.6 + 2.0) / 5
    assert terms.kl.item() == pytest.approx(sum(k3) / 5, abs=1e-6)
    assert terms.loss.item() == pytest.approx(pg + 0.1 * sum(k3) / 5, abs=1e-6)
    assert k3_kl(torch.zeros(3), torch.zeros(3)).abs().max().item() == 0.0


def test_truncated_importance_sampling():
    logp, generator, adv, mask = _inputs()
    terms = policy_loss(
        logp, generator, adv, mask, _settings("dapo", correction="truncate", is_cap=1.2), TOTALS
    )
    # weights min(r, 1.2) = [1.2, 0.7] and [0.5, 1.2, 1.0]; ratio vs the trainer itself is 1.
    expected = (-1.2 - 0.7 + 0.5 * 2 + 1.2 * 2 + 1.0 * 2) / 5
    assert terms.loss.item() == pytest.approx(expected, abs=1e-6)
    assert terms.clipped_tokens.item() == 0
    terms.loss.backward()
    assert logp.grad[0, 0].item() == pytest.approx(-1.2 / 5, abs=1e-6)
    assert logp.grad[0, 2].item() == 0.0


@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_sum_to_the_batch_loss(mode):
    logp, generator, adv, mask = _inputs()
    settings = _settings(mode, dr_grpo_max_tokens=4)
    whole = policy_loss(logp, generator, adv, mask, settings, TOTALS).loss.item()
    parts = sum(
        policy_loss(
            logp[i : i + 1], generator[i : i + 1], adv[i : i + 1], mask[i : i + 1], settings, TOTALS
        ).loss.item()
        for i in range(2)
    )
    assert parts == pytest.approx(whole, abs=1e-6)


def test_dual_clip_bounds_a_negative_advantage_token_of_huge_ratio():
    """One token (A = -2) whose trainer/generator ratio is e^10: without the dual clip it adds
    -A * r = 2 e^10 and its gradient swamps every other token's; with clip_ratio_c = 3 it adds
    -A * c = 6 and no gradient, and every other token is as before."""

    def run(clip_ratio_c: float | None):
        logp, generator, adv, mask = _inputs()
        generator[1, 1] = LOGP[1][1] - 10.0  # r = e^10 on seq 1 token 1
        settings = _settings("dapo", clip_ratio_c=clip_ratio_c)
        terms = policy_loss(logp, generator, adv, mask, settings, TOTALS)
        terms.loss.backward()
        return terms, logp.grad

    huge = 2.0 * math.exp(10.0)
    free, free_grad = run(None)
    assert free.loss.item() == pytest.approx((-1.28 - 0.7 + 1.6 + huge + 2.0) / 5, rel=1e-6)
    assert free_grad[1, 1].item() == pytest.approx(huge / 5, rel=1e-6)
    others = free_grad.clone()
    others[1, 1] = 0.0
    assert free_grad[1, 1].item() > 1000 * others.abs().max().item()  # one token dominates

    bounded, bounded_grad = run(3.0)
    assert bounded.loss.item() == pytest.approx((-1.28 - 0.7 + 1.6 + 2.0 * 3.0 + 2.0) / 5)
    assert bounded_grad[1, 1].item() == 0.0
    assert torch.equal(bounded_grad, others)  # the other tokens' gradients are untouched
    assert bounded.clipped_tokens.item() == CLIPPED + 1  # the bounded token counts as clipped
    assert free.clipped_tokens.item() == CLIPPED


def test_dual_clip_leaves_positive_advantages_and_moderate_ratios_alone():
    logp, generator, adv, mask = _inputs()
    # Every ratio in RATIOS is below 3 and seq 0 has A > 0: the bound changes nothing.
    with_bound = policy_loss(logp, generator, adv, mask, _settings("dapo"), TOTALS)
    without = policy_loss(logp, generator, adv, mask, _settings("dapo", clip_ratio_c=None), TOTALS)
    assert with_bound.loss.item() == without.loss.item()
    generator[0, 0] = LOGP[0][0] - 10.0  # huge ratio on an A > 0 token: the PPO clip caps it
    capped = policy_loss(logp, generator, adv, mask, _settings("dapo"), TOTALS)
    assert capped.loss.item() == pytest.approx(with_bound.loss.item(), abs=1e-6)


def test_with_truncation_the_dual_clip_never_acts():
    logp, generator, adv, mask = _inputs()
    generator[1, 1] = LOGP[1][1] - 10.0  # huge trainer/generator ratio, A < 0
    losses = {
        c: policy_loss(
            logp,
            generator,
            adv,
            mask,
            _settings("dapo", correction="truncate", is_cap=2.0, clip_ratio_c=c),
            TOTALS,
        ).loss.item()
        for c in (None, 3.0)
    }
    assert losses[3.0] == losses[None]  # the ratio is taken against the trainer itself: 1


# Off-policy correction. In _inputs the trainer's logprobs are the proximal ones, so the
# behaviour weight w = exp(prox - mu) of each completion token is its entry of RATIOS:
#   seq 0 (A = +1): w = 1.5, 0.7;  seq 1 (A = -2): w = 0.5, 1.3, 1.0.


def test_token_mask_drops_tokens_whose_weight_leaves_the_band():
    logp, generator, adv, mask = _inputs()
    settings = _settings("dapo", mask="token", mask_low=0.6, mask_high=1.4)
    terms = policy_loss(logp, generator, adv, mask, settings, TOTALS)
    # Outside [0.6, 1.4]: w = 1.5 (seq 0 token 0) and w = 0.5 (seq 1 token 0). Of PG the kept
    # terms are -0.7, 2.6, 2.0; N = 5 still divides (a mask removes terms, not tokens).
    assert terms.loss.item() == pytest.approx((-0.7 + 2.6 + 2.0) / 5, abs=1e-6)
    assert terms.masked_tokens.item() == 2
    terms.loss.backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[1, 0].item() == 0.0
    assert logp.grad[1, 1].item() == pytest.approx(2.0 * 1.3 / 5, abs=1e-6)


def test_token_mask_keeps_the_grpo_normalisers():
    logp, generator, adv, mask = _inputs()
    settings = _settings("grpo", mask="token", mask_low=0.6, mask_high=1.4)
    terms = policy_loss(logp, generator, adv, mask, settings, TOTALS)
    # seq 0 keeps -0.7 of 2 tokens, seq 1 keeps 2.6 + 2.0 of 3: ((-0.7)/2 + 4.6/3) / 2.
    assert terms.loss.item() == pytest.approx((-0.7 / 2 + 4.6 / 3) / 2, abs=1e-6)


def test_sequence_mask_drops_a_sequence_whose_geometric_mean_weight_leaves_the_band():
    logp, generator, adv, mask = _inputs()
    # Geometric means: seq 0 sqrt(1.5 * 0.7) = 1.0247 (kept in [0.9, 1.4]);
    # seq 1 (0.5 * 1.3 * 1.0)^(1/3) = 0.866 (masked whole). The padding slot does not count.
    settings = _settings("dapo", mask="sequence", mask_low=0.9, mask_high=1.4)
    terms = policy_loss(logp, generator, adv, mask, settings, TOTALS)
    assert terms.loss.item() == pytest.approx((-1.28 - 0.7) / 5, abs=1e-6)
    assert terms.masked_tokens.item() == 3
    # Token by token 0.5 and 1.5 leave [0.6, 1.4], yet both sequences' means are inside.
    wide = _settings("dapo", mask="sequence", mask_low=0.6, mask_high=1.4)
    kept = policy_loss(logp, generator, adv, mask, wide, TOTALS)
    assert kept.masked_tokens.item() == 0
    assert kept.loss.item() == pytest.approx((-1.28 - 0.7 + 1.6 + 2.6 + 2.0) / 5, abs=1e-6)


def test_decoupled_objective_truncates_and_masks():
    logp, generator, adv, mask = _inputs()
    settings = _settings(
        "dapo", correction="truncate", is_cap=1.2, mask="token", mask_low=0.6, mask_high=1.4
    )
    terms = policy_loss(logp, generator, adv, mask, settings, TOTALS)
    # Ratio to the proximal policy is 1, so pg = -min(w, 1.2) * A:
    #   seq 0: -1.2 (masked: w = 1.5), -0.7;  seq 1: +1.0 (masked: w = 0.5), +2.4, +2.0.
    assert terms.loss.item() == pytest.approx((-0.7 + 2.4 + 2.0) / 5, abs=1e-6)
    assert terms.masked_tokens.item() == 2
    assert terms.truncated_tokens.item() == 2  # w = 1.5 and 1.3 exceed the cap 1.2
    assert terms.clipped_tokens.item() == 0
    assert terms.ratio_max.item() == 1.0 and terms.ratio_min.item() == 1.0


def test_off_policy_statistics():
    logp, generator, adv, mask = _inputs()
    generator[1, 2] = LOGP[1][2] - math.log(4.0)  # seq 1 token 2: w = r = 4 > c = 3, A < 0
    terms = policy_loss(logp, generator, adv, mask, _settings("dapo"), TOTALS)
    # clip bounds (eps 0.2 / 0.28, c 3): high = seq 0's r = 1.5 (A > 0); low = seq 1's r = 0.5
    # (A < 0); dual = seq 1's r = 4 (A < 0). r = 0.7 (A > 0) and 1.3 (A < 0) are unclipped.
    assert (terms.clipped_high.item(), terms.clipped_low.item()) == (1, 1)
    assert terms.clipped_dual.item() == 1 and terms.clipped_tokens.item() == 3
    assert (terms.ratio_min.item(), terms.ratio_max.item()) == pytest.approx((0.5, 4.0))
    # weights 1.5, 0.7, 0.5, 1.3, 4: sum 8.0, min 0.5, max 4.
    assert terms.weight_sum.item() == pytest.approx(8.0, abs=1e-6)
    assert (terms.weight_min.item(), terms.weight_max.item()) == pytest.approx((0.5, 4.0))
    # k3 = w - ln w - 1: 0.094535 + 0.056675 + 0.193147 + 0.037636 + 1.613706 = 1.995699
    assert terms.mismatch_kl_sum.item() == pytest.approx(1.995699, abs=1e-5)
    assert terms.masked_tokens.item() == 0 and terms.truncated_tokens.item() == 0


@pytest.mark.parametrize("mask_mode", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["grpo", "dapo", "dr_grpo"])
def test_masked_micro_batches_sum_to_the_batch_loss(mode, mask_mode):
    logp, generator, adv, mask = _inputs()
    settings = _settings(
        mode,
        dr_grpo_max_tokens=4,
        correction="truncate",
        mask=mask_mode,
        mask_low=0.9,
        mask_high=1.4,
    )
    whole = policy_loss(logp, generator, adv, mask, settings, TOTALS)
    parts = [
        policy_loss(
            logp[i : i + 1], generator[i : i + 1], adv[i : i + 1], mask[i : i + 1], settings, TOTALS
        )
        for i in range(2)
    ]
    assert sum(p.loss.item() for p in parts) == pytest.approx(whole.loss.item(), abs=1e-6)
    assert sum(p.masked_tokens.item() for p in parts) == whole.masked_tokens.item() > 0
