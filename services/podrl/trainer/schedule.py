"""Learning-rate schedules as LambdaLR multipliers (warmup, then constant/linear/cosine)."""

from __future__ import annotations

import math
from collections.abc import Callable

from podrl.config import TrainerConfig


def lr_multiplier(config: TrainerConfig) -> Callable[[int], float]:
    """``step`` (optimizer steps already taken) → factor on ``config.lr``.

    warmup:  (step + 1) / warmup_steps            for step < warmup_steps
    then p = (step - warmup) / (total - warmup) clipped to [0, 1], floor = min_lr_ratio:
    constant: 1;  linear: floor + (1 - floor) * (1 - p);
    cosine: floor + (1 - floor) * (1 + cos(pi * p)) / 2
    """
    warmup, total, floor, shape = (
        config.warmup_steps,
        config.total_steps,
        config.min_lr_ratio,
        config.lr_schedule,
    )

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if shape == "constant":
            return 1.0
        progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
        if shape == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
