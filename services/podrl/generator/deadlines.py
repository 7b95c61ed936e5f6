"""Deadlines as ``time.monotonic()`` instants, and the time left until one (None: no deadline)."""

from __future__ import annotations

import time


def deadline_after(timeout: float | None) -> float | None:
    """The instant ``timeout`` seconds from now (None: no deadline)."""
    return None if timeout is None else time.monotonic() + timeout


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline``, never negative (None: no deadline)."""
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())
