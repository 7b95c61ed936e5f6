"""A reward plug-in that raises on a fixed fifth of the items it scores (the chaos run).

Which items fail is decided by a hash of the scored item (its prompt and completion), not by
chance or by order, so a run is reproducible and a test can tell from ``samples.jsonl`` alone
which rows the reward must have failed on.
"""

from __future__ import annotations

import hashlib


def raises_on(prompt: str, completion: str, error_rate: float) -> bool:
    """True for the items ``flaky_exact_match`` raises on: a fraction ``error_rate`` of the
    hash space of (prompt, completion)."""
    digest = hashlib.sha256(f"{prompt}\0{completion}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < error_rate * 2**64


def flaky_exact_match(
    completion: str, reference: str, *, prompt: str, error_rate: float = 0.2
) -> float:
    """1.0 when the completion's first line is the reference; raises on the items
    :func:`raises_on` picks."""
    if raises_on(prompt, completion, error_rate):
        raise RuntimeError(f"injected reward failure for completion {completion!r}")
    return float(completion.split("\n")[0].strip() == reference.strip())
