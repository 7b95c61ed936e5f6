"""Plug-in reward functions for the tests, named ``tests.grader.faulty_rewards:NAME``."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping


def raises(completion: str, reference: str) -> float:
    raise RuntimeError("this reward function is broken")


def sleeps_forever(completion: str, reference: str) -> float:
    while True:
        time.sleep(60)


def exits_process(completion: str, reference: str) -> float:
    os._exit(7)


def returns_text(completion: str, reference: str) -> float:
    return "not a number"  # type: ignore[return-value]


def behaves_by_completion(completion: str, reference: str, **kwargs: object) -> float:
    """Misbehaves as the completion says; otherwise 1.0 for a right answer."""
    actions = {"RAISE": raises, "HANG": sleeps_forever, "EXIT": exits_process}
    if completion in actions:
        return actions[completion](completion, reference)
    return 1.0 if completion.strip() == reference.strip() else 0.0


def uses_context(
    completion: str, reference: str, *, metadata: Mapping[str, str], bonus: float = 0.0
) -> float:
    return float(metadata.get("expected") == completion) + bonus


def wrong_signature(text: str) -> float:
    return 0.0


def needs_extra(completion: str, reference: str, threshold: float) -> float:
    return 0.0


NOT_A_FUNCTION = 3

LAMBDA = lambda completion, reference: 1.0  # noqa: E731
