"""Scoring one item: a task's reward plan, its weighted sum, and the built-in reward functions.

This is what runs in a scoring worker process (or, for plans of cheap built-ins only, in the
grader's thread). Plans hold the reward functions themselves; they travel to the workers pickled
by reference (module + name), so every function must be importable at module level.

Each reward function takes ``(completion, reference, **params)`` and returns a float; all
built-ins but ``length_penalty`` score on a 0-1 scale. ``answer_tag`` (where offered) first
extracts the text inside the last ``<tag>...</tag>`` of the completion; a completion without the
tags then scores 0.
"""

from __future__ import annotations

import json
import math
import numbers
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
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


# ---- the built-in reward functions -----------------------------------------------------------


def cut_at(completion: str, stop: str | None) -> str:
    """The completion up to the first ``stop`` marker (all of it when None or absent)."""
    return completion if not stop else completion.split(stop, 1)[0]


def extract_tagged(completion: str, tag: str | None) -> str | None:
    """The text inside the last ``<tag>...</tag>`` (stripped), or the completion when ``tag`` is
    None; None when the tags are missing."""
    if tag is None:
        return completion
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", completion, re.DOTALL)
    return matches[-1].strip() if matches else None


def exact_match(
    completion: str,
    reference: str,
    *,
    answer_tag: str | None = None,
    strip: bool = True,
    case_sensitive: bool = True,
    stop: str | None = None,
) -> float:
    """1.0 when the answer equals the reference (after stripping whitespace, by default).
    ``stop`` cuts the completion at its first occurrence (e.g. ``"\n"``) before comparing."""
    answer = extract_tagged(cut_at(completion, stop), answer_tag)
    if answer is None:
        return 0.0
    if strip:
        answer, reference = answer.strip(), reference.strip()
    if not case_sensitive:
        answer, reference = answer.casefold(), reference.casefold()
    return 1.0 if answer == reference else 0.0


def regex_match(
    completion: str,
    reference: str,
    *,
    pattern: str,
    full_match: bool = False,
    group: int | str | None = None,
) -> float:
    """1.0 when ``pattern`` matches the completion (anywhere, or all of it with ``full_match``);
    with ``group`` the captured text must also equal the reference (both stripped)."""
    compiled = _compiled(pattern)
    match = compiled.fullmatch(completion) if full_match else compiled.search(completion)
    if match is None:
        return 0.0
    if group is None:
        return 1.0
    captured = match.group(group)
    return 1.0 if captured is not None and captured.strip() == reference.strip() else 0.0


@cache
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.DOTALL)


def format_reward(
    completion: str, reference: str, *, tag: str = "answer", strict: bool = False
) -> float:
    """1.0 when the completion holds exactly one non-empty ``<tag>...</tag>``; with ``strict``
    nothing but whitespace may stand outside it."""
    pattern = rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>"
    matches = list(re.finditer(pattern, completion, re.DOTALL))
    if len(matches) != 1 or not matches[0].group(1).strip():
        return 0.0
    if strict and completion.strip() != matches[0].group(0):
        return 0.0
    return 1.0


def char_match(
    completion: str,
    reference: str,
    *,
    answer_tag: str | None = None,
    strip: bool = True,
    stop: str | None = None,
) -> float:
    """Share of positions where answer and reference agree, over the longer length: partial
    credit for short string answers (1.0 = identical, 0.0 = nothing in place). ``stop`` as in
    exact_match."""
    answer = extract_tagged(cut_at(completion, stop), answer_tag)
    if answer is None:
        return 0.0
    if strip:
        answer, reference = answer.strip(), reference.strip()
    longest = max(len(answer), len(reference))
    if longest == 0:
        return 1.0
    return sum(a == b for a, b in zip(answer, reference, strict=False)) / longest


def length_penalty(
    completion: str,
    reference: str,
    *,
    max_chars: int,
    free_chars: int = 0,
    penalty: float = 1.0,
) -> float:
    """0.0 up to ``free_chars`` characters, then falling linearly to ``-penalty`` at
    ``max_chars`` and staying there (characters, since the grader sees text, not tokens)."""
    if max_chars <= free_chars:
        raise ValueError(f"max_chars ({max_chars}) must exceed free_chars ({free_chars})")
    over = min(max(len(completion) - free_chars, 0), max_chars - free_chars)
    return -penalty * over / (max_chars - free_chars)


def math_verify_reward(completion: str, reference: str, *, answer_tag: str | None = None) -> float:
    """1.0 when math-verify finds the answer equivalent to the reference (fractions, decimals,
    LaTeX, sets, intervals, percentages, ``\\boxed{}``, text units such as ``\\text{cm}``)."""
    from math_verify import parse, verify

    answer = extract_tagged(completion, answer_tag)
    if answer is None:
        return 0.0
    # math-verify's own timeout uses SIGALRM, which works only on the main thread (the pool's
    # workers); elsewhere the pool's per-item timeout is the guard.
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse(_as_math(reference), parsing_timeout=limit)
    predicted = parse(_as_math(answer), parsing_timeout=limit)
    if not gold or not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=limit) else 0.0


def _as_math(text: str) -> str:
    # A bare LaTeX answer ("\frac{1}{2}") needs math delimiters for math-verify's LaTeX parser.
    if "\\" in text and "$" not in text and "\\(" not in text and "\\[" not in text:
        return f"${text}$"
    return text


def reasoning_gym_score(
    completion: str,
    reference: str,
    *,
    metadata: Mapping[str, str],
    dataset: str | None = None,
    answer_tag: str | None = "answer",
) -> float:
    """The dataset's own ``score_answer`` (reasoning-gym), on the entry the task source stored
    in the item's metadata (or ``{"answer": reference}`` when there is none)."""
    from podrl.tasks.reasoning_gym_source import DATASET_KEY, ENTRY_KEY

    name = dataset or metadata.get(DATASET_KEY)
    if not name:
        raise ValueError(
            f"reasoning_gym reward: set params.dataset or send metadata[{DATASET_KEY!r}]"
        )
    entry: dict[str, Any]
    if ENTRY_KEY in metadata:
        entry = json.loads(metadata[ENTRY_KEY])
    else:
        entry = {"question": "", "answer": reference, "metadata": {}}
    answer = extract_tagged(completion, answer_tag)
    if answer is not None:
        answer = answer.strip()
    return float(_reasoning_gym_scorer(name)(answer, entry))


@cache
def _reasoning_gym_scorer(name: str) -> Any:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)


BUILTIN_REWARDS = {
    "reasoning_gym": reasoning_gym_score,
    "math_verify": math_verify_reward,
    "exact_match": exact_match,
    "regex_match": regex_match,
    "format": format_reward,
    "char_match": char_match,
    "length_penalty": length_penalty,
}
"""Name -> function; a task's ``rewards[].name`` picks one."""
