"""The task-source interface: a deterministic, resumable stream of prompts."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

Position = dict[str, Any]
"""A source's place in its stream: plain JSON (ints, strings, nested dicts)."""


@dataclass(frozen=True)
class PromptItem:
    """One prompt drawn from a task, with what the grader needs to score its completions."""

    id: str
    """Unique within the run's stream, e.g. ``arith/17``; stable for the same seed."""
    task: str
    """The task name (ScoreItem.task)."""
    prompt: str
    """The prompt text with the task's template applied (what the generator sees)."""
    reference: str
    """The reference answer (ScoreItem.reference)."""
    target: str
    """The ideal completion (the task's target_template over the reference) for warm-starts."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Strings forwarded as ScoreItem.metadata (reward functions may read them)."""


class TaskSource(ABC):
    """A deterministic prompt stream: the same seed gives the same items in the same order, and
    ``restore(position())`` continues exactly where the stream was (no repeats, no gaps)."""

    @property
    @abstractmethod
    def task_names(self) -> list[str]:
        """The task names this source can emit."""

    @abstractmethod
    def next_prompts(self, n: int) -> list[PromptItem]:
        """The next ``n`` items of the stream (advances the position)."""

    @abstractmethod
    def position(self) -> Position:
        """Where the stream is now, as a JSON-serialisable dict."""

    @abstractmethod
    def restore(self, position: Position) -> None:
        """Continue from ``position`` (a value ``position()`` returned, possibly after JSON)."""


class PositionError(ValueError):
    """A saved position that does not fit this source (another config, or corrupted)."""


def derive_seed(seed: int, name: str) -> int:
    """A stable 32-bit seed for ``name`` under the run seed (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def position_int(position: Position, key: str, source: str) -> int:
    value = position.get(key) if isinstance(position, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PositionError(
            f"{source}: saved position {position!r} has no non-negative integer {key!r}"
        )
    return value
