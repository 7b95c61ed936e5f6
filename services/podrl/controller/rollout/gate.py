"""The generator gate of asynchronous mode (``loop.mode: async``).

Who may use the generators. The producer holds it for one batch's
``Generate`` fan-out; the loop holds it (with priority: the producer starts no new batch
while the loop waits) around each ``ApplyWeights`` of a weight sync (the trainers' publish
and acknowledgment need no generator), for the step boundary (align: pods admitted,
generators brought to their trainers' version) and for evaluations. So weights are applied
to each pod's generator between its generation batches, never in the middle of one; with
``loop.weight_apply: in_flight`` the syncs and aligns take no gate (the generators apply in
the middle of a batch, ``podrl.generator.weight_applier``), evaluations still do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class GeneratorGate:
    """Who may use the generators: the producer alone, for one batch; or the loop (first in
    line), for weight syncs, step boundaries and evaluations. The loop's side may be held by
    several of its threads at once (a sync applies to every pod's generator in parallel, and
    an align inside an evaluation's hold may apply one), never together with the producer."""

    def __init__(self, poll_seconds: float) -> None:
        """``poll_seconds``: how often a waiting producer looks at its stop flag
        (``loop.stop_poll_seconds``)."""
        self._poll_seconds = poll_seconds
        self._cond = threading.Condition()
        self._producer_holds = False
        self._loop_holders = 0
        self._loop_waiting = 0

    @contextmanager
    def producer(self, stopped: Callable[[], bool]) -> Iterator[bool]:
        """Yields False (holding nothing) when ``stopped()`` turned true while waiting."""

        def taken() -> bool:
            return self._producer_holds or self._loop_holders > 0 or self._loop_waiting > 0

        acquired = False
        with self._cond:
            while taken() and not stopped():
                self._cond.wait(self._poll_seconds)
            if not taken():
                self._producer_holds = acquired = True
        if not acquired:
            yield False
            return
        try:
            yield True
        finally:
            with self._cond:
                self._producer_holds = False
                self._cond.notify_all()

    @contextmanager
    def loop(self) -> Iterator[None]:
        with self._cond:
            self._loop_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._producer_holds)
            finally:
                self._loop_waiting -= 1
            self._loop_holders += 1
        try:
            yield
        finally:
            with self._cond:
                self._loop_holders -= 1
                self._cond.notify_all()
