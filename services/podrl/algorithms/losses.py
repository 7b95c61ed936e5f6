r"""Policy-gradient losses of the GRPO family, computed per token and reduced over a batch.

Notation, for sequence ``b`` and completion token ``t`` (prompt and padding tokens have mask
``m_bt = 0`` and contribute nothing):

    logp_bt   trainer log-probability of the sampled token (carries the gradient)
    mu_bt     the generator's (behaviour policy's) log-probability of the same token
    A_b       the sequence's group-relative advantage (``podrl.algorithms.advantages``)
    r_bt      = exp(logp_bt - mu_bt), the importance ratio against the generator
    pg_bt     = -min(r_bt * A_b, clip(r_bt, 1 - eps_low, 1 + eps_high) * A_b)
    pg_bt     = min(pg_bt, -A_b * c)          if A_b < 0 (dual clip, c = clip_ratio_c > 1)
    kl_bt     = exp(ref_bt - logp_bt) - (ref_bt - logp_bt) - 1     (k3 estimator of KL(pi||ref))
    l_bt      = pg_bt + beta * kl_bt                                 (beta = kl_coef)

Truncated importance sampling (``tis_cap = C``; Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"): the PPO ratio is taken against the trainer's own
log-probabilities at the start of the step, ``old_bt = stopgrad(logp_bt)``, and the
trainer/generator mismatch is corrected by a truncated weight:

    r_bt      = exp(logp_bt - old_bt)            (value 1, gradient of logp_bt)
    w_bt      = min(exp(old_bt - mu_bt), C)
    pg_bt     = -w_bt * min(r_bt * A_b, clip(r_bt, 1 - eps_low, 1 + eps_high) * A_b)

The reductions over a batch of B sequences with n_b completion tokens each
(N = sum_b n_b) differ between the modes:

    grpo      L = (1/B) * sum_b (1/n_b) * sum_t m_bt * l_bt       (sequence mean of token means)
    dapo      L = (1/N) * sum_b sum_t m_bt * l_bt                  (token-level mean)
    dr_grpo   L = (1/(B * L_max)) * sum_b sum_t m_bt * l_bt        (constant normaliser: no
                                                                    length bias; L_max is the
                                                                    generation budget)

The dual clip (Ye et al. 2020, "Mastering complex control in MOBA games with deep RL"; verl's
``clip_ratio_c``, default 3) bounds what one token with a negative advantage can add: the PPO
clip only caps the ratio from above for ``A > 0``, so a token whose trainer/generator ratio is
huge (stale weights, a bf16 generator, a different kernel) would otherwise add ``-A * r`` and
dominate the batch. Bounded tokens get no gradient; ``clip_ratio_c = None`` turns it off.

DAPO's asymmetric clip is ``eps_high > eps_low`` (the paper uses 0.2 / 0.28); Dr. GRPO also
drops the std normalisation of the advantages (``normalize_std=False`` on the controller side).

A batch is split over data-parallel ranks and micro-batches; ``BatchTotals`` carries the
batch-wide B and N so that the sum of the micro-batch losses is exactly the batch loss above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LossMode = Literal["grpo", "dapo", "dr_grpo"]


@dataclass(frozen=True)
class LossSettings:
    """The knobs of the loss (see the module docstring for where each one enters)."""

    mode: LossMode = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    tis_cap: float | None = None
    dr_grpo_max_tokens: int = 1024
    clip_ratio_c: float | None = 3.0


@dataclass(frozen=True)
class BatchTotals:
    """Batch-wide counts the reduction divides by (the whole batch, all ranks)."""

    num_sequences: int
    num_tokens: int


@dataclass
class LossTerms:
    """One micro-batch's contribution to the batch loss, and sums for metrics.

    ``loss``, ``pg_loss`` and ``kl`` are already divided by the batch-wide normaliser, so
    summing them over micro-batches and ranks gives the batch values. The ``*_sum`` fields are
    plain sums over this micro-batch's completion tokens (divide by the batch's token count).
    """

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    ratio_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    tokens: torch.Tensor


def token_weights(mask: torch.Tensor, settings: LossSettings, totals: BatchTotals) -> torch.Tensor:
    """Per-token weights w_bt such that the batch loss is sum_bt w_bt * l_bt."""
    mask = mask.to(torch.float32)
    if settings.mode == "grpo":
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        return mask / lengths / max(totals.num_sequences, 1)
    if settings.mode == "dapo":
        return mask / max(totals.num_tokens, 1)
    if settings.mode == "dr_grpo":
        return mask / (max(totals.num_sequences, 1) * settings.dr_grpo_max_tokens)
    raise ValueError(f"loss mode {settings.mode!r} is not one of grpo, dapo, dr_grpo")


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref) per token: exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    delta = ref_logprobs - logprobs
    return torch.exp(delta) - delta - 1.0


def policy_loss(
    logprobs: torch.Tensor,
    generator_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    settings: LossSettings,
    totals: BatchTotals,
    ref_logprobs: torch.Tensor | None = None,
) -> LossTerms:
    """The loss of one micro-batch; shapes: ``[B, T]`` per token, ``advantages`` ``[B]``.

    ``mask`` is 1 on completion tokens and 0 on prompt and padding tokens.
    """
    logprobs = logprobs.to(torch.float32)
    generator_logprobs = generator_logprobs.to(torch.float32)
    mask = mask.to(torch.float32)
    adv = advantages.to(torch.float32).unsqueeze(-1)
    # Masked positions may hold anything (padding): keep them out of exp() overflow.
    generator_logprobs = torch.where(mask > 0, generator_logprobs, logprobs.detach())
    low, high = 1.0 - settings.clip_eps_low, 1.0 + settings.clip_eps_high
    if settings.tis_cap is None:
        ratio = torch.exp(logprobs - generator_logprobs)
        is_weight = None
    else:
        old = logprobs.detach()
        ratio = torch.exp(logprobs - old)
        is_weight = torch.exp(old - generator_logprobs).clamp(max=settings.tis_cap)
    unclipped = ratio * adv
    clipped = ratio.clamp(low, high) * adv
    pg_tokens = -torch.minimum(unclipped, clipped)
    negative = adv < 0
    if settings.clip_ratio_c is not None:
        bound = -adv * settings.clip_ratio_c
        pg_tokens = torch.where(negative, torch.minimum(pg_tokens, bound), pg_tokens)
    if is_weight is not None:
        pg_tokens = pg_tokens * is_weight
    weights = token_weights(mask, settings, totals)
    pg_loss = (weights * pg_tokens).sum()
    if ref_logprobs is not None and settings.kl_coef > 0:
        ref = torch.where(mask > 0, ref_logprobs.to(torch.float32), logprobs.detach())
        kl = (weights * k3_kl(logprobs, ref)).sum()
        loss = pg_loss + settings.kl_coef * kl
    else:
        kl = torch.zeros((), dtype=torch.float32, device=logprobs.device)
        loss = pg_loss
    with torch.no_grad():
        is_clipped = ((adv > 0) & (ratio > high)) | (negative & (ratio < low))
        if settings.clip_ratio_c is not None:
            is_clipped = is_clipped | (negative & (ratio > settings.clip_ratio_c))
        ratio_sum = (ratio.detach() * mask).sum()
        clipped_tokens = (is_clipped.to(torch.float32) * mask).sum()
        tokens = mask.sum()
    return LossTerms(loss, pg_loss.detach(), kl.detach(), ratio_sum, clipped_tokens, tokens)
