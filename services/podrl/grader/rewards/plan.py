"""A task's reward plan and how one item is scored with it (this runs in a worker process).

Plans hold the reward functions themselves; they travel to the workers pickled by reference
(module + name), so every function must be importable at module level.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

CONTEXT_ARGUMENTS = ("prompt", "task", "metadata")
"""Keyword arguments a reward function receives when its signature names them (or **kwargs)."""


@dataclass(frozen=True)
class RewardComponent:
    label: str
    """Key in ItemScore.components and in metrics."""
    function: Any
    """The reward callable: ``function(completion, reference, **params, **context) -> float``."""
    weight: float
    params: Mapping[str, Any]
    context: tuple[str, ...]
    """Which of CONTEXT_ARGUMENTS the function accepts."""
    source: str
    """Where it came from (built-in name or import path), for messages."""


@dataclass(frozen=True)
class TaskRewardPlan:
    task: str
    components: tuple[RewardComponent, ...]
    fallback_reward: float


@dataclass(frozen=True)
class ItemInput:
    prompt: str
    completion: str
    reference: str
    task: str
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ItemOutput:
    reward: float
    components: dict[str, float]
    seconds: float


class InvalidRewardError(TypeError):
    """A reward function returned something other than a finite number."""


def score_with_plan(plan: TaskRewardPlan, item: ItemInput) -> ItemOutput:
    """The weighted sum of the plan's rewards for ``item`` (raises what a reward raises)."""
    start = time.perf_counter()
    context = {"prompt": item.prompt, "task": item.task, "metadata": item.metadata}
    components: dict[str, float] = {}
    total = 0.0
    for component in plan.components:
        kwargs = {name: context[name] for name in component.context}
        value = component.function(item.completion, item.reference, **component.params, **kwargs)
        components[component.label] = _as_reward(value, component)
        total += component.weight * components[component.label]
    return ItemOutput(total, components, time.perf_counter() - start)


def _as_reward(value: object, component: RewardComponent) -> float:
    if not isinstance(value, numbers.Real):
        raise InvalidRewardError(
            f"reward {component.label} ({component.source}) returned {type(value).__name__} "
            f"{value!r:.80}; a reward function must return a number"
        )
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRewardError(
            f"reward {component.label} ({component.source}) returned {number}; rewards must be "
            "finite"
        )
    return number
