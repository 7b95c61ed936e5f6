"""What an environment is: a Python class with ``reset`` and ``step``, the interface of the
built-ins and of users' plug-ins (``environments.plugins``).

One object plays one episode. The service constructs it in a worker process with the
environment's ``environments.params``, calls ``reset`` once and ``step`` once per turn, and
between two calls keeps it pickled (the next step may run in another worker), so an environment
holds its episode's state in attributes that pickle: numbers, strings, lists, dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class StepResult:
    """What one turn gives back."""

    observation: str = ""
    """The reply the model reads next (a tool's result, feedback); cut at
    ``environments.max_tool_output_chars``."""
    reward: float = 0.0
    """This turn's reward; on the turn that ends the episode, its final reward."""
    done: bool = False
    tool_calls: int = 0
    """Tool calls this turn ran."""
    tool_errors: int = 0
    """Of those, how many failed (the model's mistake, e.g. a malformed expression)."""


class Environment:
    """Base class of environments; a plug-in may subclass it or just define the two methods.

    Raising from ``reset`` or ``step`` fails the episode (its caller gets INTERNAL); a malformed
    action is not a reason to raise: reply with what was wrong, as the built-ins do."""

    def reset(self, prompt: str, reference: str, metadata: Mapping[str, str], seed: int) -> str:
        """Start the episode of the task item (``prompt``, ``reference``, ``metadata``);
        ``seed`` for anything drawn at random. Returns the observation shown before the first
        turn ("" when the prompt says it all)."""
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        """One turn: ``action`` is the text the model produced."""
        raise NotImplementedError
