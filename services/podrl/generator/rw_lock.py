"""A writer-preferring readers-writer lock: many generate calls, or one weight swap.

Generate calls hold the read side for their whole duration, ApplyWeights the write side, so a
generate call runs entirely on one policy version. A waiting writer blocks new readers, so a
steady stream of generate calls cannot starve a weight update.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from podrl.generator.engine_runtime import deadline_after, seconds_left


class LockTimeoutError(TimeoutError):
    """The lock was not acquired within the caller's deadline."""


class ReadWriteLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def read(self, timeout: float | None = None) -> Iterator[None]:
        deadline = deadline_after(timeout)
        with self._cond:
            while self._writer or self._writers_waiting:
                if not self._cond.wait(seconds_left(deadline)):
                    raise LockTimeoutError("timed out waiting for a weight update to finish")
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    @contextmanager
    def write(self, timeout: float | None = None) -> Iterator[None]:
        deadline = deadline_after(timeout)
        with self._cond:
            self._writers_waiting += 1
            try:
                while self._writer or self._readers:
                    if not self._cond.wait(seconds_left(deadline)):
                        raise LockTimeoutError("timed out waiting for generate calls to finish")
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # readers held back by this writer may go on a timeout
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
