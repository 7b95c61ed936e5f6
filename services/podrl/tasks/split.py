"""Which part of a task's prompt space a prompt is in: evaluation, warm-start or RL training.

The part is a function of the task name and the prompt text alone (:func:`part_of`), so the
parts never share a prompt, whatever seeds the streams drawing from them use. A stream of one
part skips every record whose prompt lies in another (``TaskStream``).
"""

from __future__ import annotations

import hashlib
from typing import Literal

from podrl.config.tasks import SplitConfig

Part = Literal["train", "warm_start", "eval"]
PARTS: tuple[Part, ...] = ("train", "warm_start", "eval")


def unit_hash(task: str, prompt: str) -> float:
    """A stable number in [0, 1) for (task, prompt) (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{task}\0{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def part_of(task: str, prompt: str, split: SplitConfig) -> Part:
    """The part ``prompt`` of task ``task`` belongs to under ``split``."""
    u = unit_hash(task, prompt)
    if u < split.eval:
        return "eval"
    if u < split.eval + split.warm_start:
        return "warm_start"
    return "train"
