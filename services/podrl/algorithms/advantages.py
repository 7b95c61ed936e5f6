"""Group-relative advantages, the GRPO baseline, in pure Python (the controller has no torch).

For one prompt with G sampled completions and rewards r_1..r_G:

    mean  = (1/G) * sum_i r_i
    std   = sqrt((1/(G-1)) * sum_i (r_i - mean)^2)      (sample std, as in GRPO)
    A_i   = (r_i - mean) / (std + eps)                   if normalize_std (GRPO, DAPO)
    A_i   = r_i - mean                                   otherwise (Dr. GRPO)

A group whose rewards are all equal (std <= zero_variance_tol) carries no learning signal (every
A_i is 0): it is dropped, its completions are not sent to the trainer; a group of fewer than two
completions is dropped for the same reason. Dropped groups are not replaced, so the batch
shrinks, down to nothing (the step then trains nothing). This is only the filtering half of
DAPO's "dynamic sampling": DAPO also samples more prompts until the batch is full again, which
podrl does not do.

The rewards given here must be real ones: the controller leaves samples whose scoring failed
out before calling this (``podrl.controller.step.batch``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupAdvantages:
    """Advantages of one prompt's group of completions."""

    key: str
    """The group's key (the prompt id) as given."""
    advantages: tuple[float, ...]
    """One advantage per completion, in input order; empty when the group was dropped."""
    mean: float
    std: float
    dropped: bool
    """True when the group had (near) zero reward variance or fewer than two completions."""


def group_advantages(
    rewards: Sequence[float],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    zero_variance_tol: float = 1e-8,
    key: str = "",
) -> GroupAdvantages:
    """Advantages of one group of rewards (see the module docstring for the formula)."""
    values = [float(r) for r in rewards]
    for index, value in enumerate(values):
        if not math.isfinite(value):
            raise ValueError(f"rewards[{index}] of group {key!r} is {value}; must be finite")
    count = len(values)
    if count == 0:
        return GroupAdvantages(key, (), 0.0, 0.0, dropped=True)
    mean = math.fsum(values) / count
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (count - 1)) if count > 1 else 0.0
    if count < 2 or std <= zero_variance_tol:
        return GroupAdvantages(key, (), mean, std, dropped=True)
    scale = 1.0 / (std + eps) if normalize_std else 1.0
    return GroupAdvantages(key, tuple((v - mean) * scale for v in values), mean, std, False)


def batch_advantages(
    groups: Mapping[str, Sequence[float]],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
    zero_variance_tol: float = 1e-8,
) -> dict[str, GroupAdvantages]:
    """Advantages of every group of a batch, keyed like ``groups`` (prompt id → rewards).

    Dropped groups stay in the result with ``dropped=True`` so callers can count them.
    """
    return {
        key: group_advantages(
            rewards,
            normalize_std=normalize_std,
            eps=eps,
            zero_variance_tol=zero_variance_tol,
            key=key,
        )
        for key, rewards in groups.items()
    }
