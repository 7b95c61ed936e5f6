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

Off-policy samples (``correction``, ``mask``: :class:`LossSettings`). A token may have been
sampled by an older policy (asynchronous mode) or by a generator whose numbers differ from the
trainer's (another kernel, precision or shard layout). The decoupled PPO objective (Fu et al.
2025, "AReaL"; Hilton et al. 2022, "Batch size-invariance for policy optimization") separates
the two policies the plain ratio mixes: the trust region is taken around the **proximal** policy,
the trainer's own policy at the start of the step, and the gap to the **behaviour** policy that
sampled the token is an importance weight. With one optimizer step per batch the proximal
log-probabilities are the trainer's own, detached: ``prox_bt = stopgrad(logp_bt)``.

    w_bt      = exp(prox_bt - mu_bt)             behaviour importance weight (no gradient)

    correction "none"      r_bt = exp(logp_bt - mu_bt)       (plain PPO against the behaviour
                           pg_bt as above                     policy: the default in sync mode)
    correction "truncate"  r_bt = exp(logp_bt - prox_bt)     (value 1, gradient of logp_bt)
                           pg_bt = -min(w_bt, C) * min(r_bt * A_b, clip(r_bt, ...) * A_b)
                                                              (C = is_cap; Yao et al. 2025 "TIS")

Masking of extreme weights multiplies the policy-gradient term by ``keep_bt`` in {0, 1}; the
normalisers of the reduction are unchanged (a masked token still counts in n_b and N), so a
mask only removes terms:

    mask "none"      keep_bt = 1
    mask "token"     keep_bt = [lo <= w_bt <= hi]                      (IcePop, Ling team 2025)
    mask "sequence"  keep_bt = [lo <= g_b <= hi],  g_b = exp((1/n_b) sum_t m_bt (prox_bt - mu_bt))
                                                    (geometric mean weight of the sequence; TRL's
                                                    sequence mask, "MIS")

with ``lo = mask_low``, ``hi = mask_high``. The KL penalty to the reference is not masked: it
does not involve the behaviour policy.

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

import math
from dataclasses import dataclass
from typing import Literal

import torch

LossMode = Literal["grpo", "dapo", "dr_grpo"]
Correction = Literal["none", "truncate"]
MaskMode = Literal["none", "token", "sequence"]


@dataclass(frozen=True)
class LossSettings:
    """The knobs of the loss (see the module docstring for where each one enters)."""

    mode: LossMode = "grpo"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    dr_grpo_max_tokens: int = 1024
    clip_ratio_c: float | None = 3.0
    correction: Correction = "none"
    is_cap: float = 2.0
    mask: MaskMode = "none"
    mask_low: float = 0.5
    mask_high: float = 5.0


@dataclass(frozen=True)
class BatchTotals:
    """Batch-wide counts the reduction divides by (the whole batch, all ranks)."""

    num_sequences: int
    num_tokens: int


@dataclass
class LossTerms:
    """One micro-batch's contribution to the batch loss, and sums and extremes for metrics.

    ``loss``, ``pg_loss`` and ``kl`` are already divided by the batch-wide normaliser, so
    summing them over micro-batches and ranks gives the batch values. The ``*_sum`` and count
    fields are plain sums over this micro-batch's completion tokens (divide by the batch's token
    count); the ``*_max``/``*_min`` fields are extremes over them (``-inf``/``+inf`` without
    completion tokens), to be reduced by max/min.
    """

    loss: torch.Tensor
    pg_loss: torch.Tensor
    kl: torch.Tensor
    ratio_sum: torch.Tensor
    clipped_tokens: torch.Tensor
    tokens: torch.Tensor
    # The clipped tokens by which bound is the active term: A > 0 and r > 1 + eps_high (high),
    # A < 0 and r < 1 - eps_low (low), A < 0 and r > clip_ratio_c (dual).
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor
    clipped_dual: torch.Tensor
    # Behaviour weight w = exp(prox - mu) before truncation, and k3 of KL(behaviour || trainer).
    weight_sum: torch.Tensor
    mismatch_kl_sum: torch.Tensor
    masked_tokens: torch.Tensor
    truncated_tokens: torch.Tensor
    ratio_max: torch.Tensor
    ratio_min: torch.Tensor
    weight_max: torch.Tensor
    weight_min: torch.Tensor


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


def keep_mask(log_weight: torch.Tensor, mask: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """``keep_bt`` of the module docstring (1 = the token's policy-gradient term counts) from
    ``log_weight = prox - mu`` (``[B, T]``, any value where ``mask`` is 0)."""
    if settings.mask == "none":
        return torch.ones_like(mask)
    low, high = math.log(settings.mask_low), math.log(settings.mask_high)
    if settings.mask == "token":
        inside = (log_weight >= low) & (log_weight <= high)
    elif settings.mask == "sequence":
        # Compared in log space: the geometric mean of e^x is e^(mean x).
        lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
        mean = (log_weight * mask).sum(dim=-1, keepdim=True) / lengths
        inside = ((mean >= low) & (mean <= high)).expand_as(mask)
    else:
        raise ValueError(f"mask {settings.mask!r} is not one of none, token, sequence")
    return inside.to(mask.dtype)


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
    # One optimizer step per batch: the proximal policy is the trainer's, detached.
    proximal = logprobs.detach()
    log_weight = proximal - generator_logprobs
    weight = torch.exp(log_weight)
    if settings.correction == "none":
        ratio = torch.exp(logprobs - generator_logprobs)
        is_weight = None
    elif settings.correction == "truncate":
        ratio = torch.exp(logprobs - proximal)
        is_weight = weight.clamp(max=settings.is_cap)
    else:
        raise ValueError(f"correction {settings.correction!r} is not one of none, truncate")
    unclipped = ratio * adv
    clipped = ratio.clamp(low, high) * adv
    pg_tokens = -torch.minimum(unclipped, clipped)
    negative = adv < 0
    if settings.clip_ratio_c is not None:
        bound = -adv * settings.clip_ratio_c
        pg_tokens = torch.where(negative, torch.minimum(pg_tokens, bound), pg_tokens)
    if is_weight is not None:
        pg_tokens = pg_tokens * is_weight
    keep = keep_mask(log_weight, mask, settings)
    weights = token_weights(mask, settings, totals)
    pg_loss = (weights * keep * pg_tokens).sum()
    if ref_logprobs is not None and settings.kl_coef > 0:
        ref = torch.where(mask > 0, ref_logprobs.to(torch.float32), logprobs.detach())
        kl = (weights * k3_kl(logprobs, ref)).sum()
        loss = pg_loss + settings.kl_coef * kl
    else:
        kl = torch.zeros((), dtype=torch.float32, device=logprobs.device)
        loss = pg_loss
    with torch.no_grad():
        ratio = ratio.detach()
        on = mask > 0
        clipped_high = (adv > 0) & (ratio > high) & on
        clipped_low = negative & (ratio < low) & on
        clipped_dual = torch.zeros_like(on)
        if settings.clip_ratio_c is not None:
            clipped_dual = negative & (ratio > settings.clip_ratio_c) & on
        truncated = torch.zeros_like(on)
        if is_weight is not None:
            truncated = (weight > settings.is_cap) & on

        def count(flags: torch.Tensor) -> torch.Tensor:
            return flags.to(torch.float32).sum()

        terms = LossTerms(
            loss=loss,
            pg_loss=pg_loss.detach(),
            kl=kl.detach(),
            ratio_sum=(ratio * mask).sum(),
            clipped_tokens=count(clipped_low | clipped_high | clipped_dual),
            tokens=mask.sum(),
            clipped_low=count(clipped_low),
            clipped_high=count(clipped_high),
            clipped_dual=count(clipped_dual),
            weight_sum=(weight * mask).sum(),
            # KL(behaviour || trainer) from the behaviour's own samples: k3 with ref = trainer.
            mismatch_kl_sum=(k3_kl(generator_logprobs, proximal) * mask).sum(),
            masked_tokens=((1.0 - keep) * mask).sum(),
            truncated_tokens=count(truncated),
            ratio_max=ratio.masked_fill(~on, -math.inf).max(),
            ratio_min=ratio.masked_fill(~on, math.inf).min(),
            weight_max=weight.masked_fill(~on, -math.inf).max(),
            weight_min=weight.masked_fill(~on, math.inf).min(),
        )
    return terms
