"""Asynchronous mode (``loop.mode: async``): a producer generates and scores the prompts of
the next steps while the trainers train, into a bounded buffer of scored steps.

The parts, read in this order (the generator gate both sides hold is ``gate.py``):

- :func:`may_start`: the bound (pure). The batch of step ``j`` may be started once step
  ``j - 1 - max_staleness`` is done. Its groups are then sampled by a version at least the one
  that step left, and step ``j`` trains at most ``max_staleness`` versions later, so in a run
  whose generators take every sync nothing is dropped as stale; with ``max_staleness`` 0 the
  batch of step ``j`` starts only after step ``j - 1`` is done: the synchronous order.
- :class:`RolloutProducer`: the producer's two threads and the buffer. The generating thread
  draws each step's prompts from the task source in step order (one ``next_prompts`` call per
  step, as the synchronous loop does) and generates them; the scoring thread scores the batches
  in the same order, so a batch scores while the next one generates (the grader and the
  generator are different processes). Each batch keeps the data positions before and after its
  prompts, so the step record stores the position after the prompts that step trained (or
  dropped). A restarted controller continues from there: the prompts that were in the buffer
  are drawn and generated again, none is skipped and none trained twice. A batch whose generate
  or score phase failed is handed to the loop as that failure, and no further step starts until
  the loop, after its retry rules (backoff, wait for workers, align), asks for the same prompts
  again (:meth:`retry`); a step whose batch was already generating when its predecessor's
  scoring failed is kept (it is scored, or fails, on its own).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from podrl.controller import loop_metrics as metrics
from podrl.controller.step.batch import StepSamples
from podrl.controller.step_errors import RunFailedError, StepFailedError

log = logging.getLogger(__name__)


def may_start(step: int, steps_done: int, max_staleness: int) -> bool:
    """The producer may start the batch of ``step`` once ``steps_done`` steps are done: at most
    ``max_staleness`` steps ahead of the one being trained (``steps_done + 1``)."""
    return step <= steps_done + 1 + max_staleness


def buffer_capacity_steps(max_staleness: int) -> int:
    """Scored steps the buffer can hold: the step about to train and ``max_staleness`` more."""
    return max_staleness + 1


@dataclass
class ScoredBatch:
    """One step's prompts, generated and scored by the producer (or the failure of that)."""

    step: int
    data: StepSamples
    position_before: dict[str, Any]
    position_after: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    """generate / score seconds of the producer (overlapping the previous steps' training)."""
    error: StepFailedError | None = None
    """The attempt failed (generate or score); nothing of it may be trained on."""


#: Generates step ``step``'s batch: new prompts (second argument None) or, after a failed
#: attempt, the same prompts again (the failed batch). Returns the batch with ``error`` set on a
#: failed generate phase; anything it raises ends the producer and fails the run.
Generate = Callable[[int, ScoredBatch | None], ScoredBatch]
#: Scores a generated batch in place, setting its ``error`` on a failed score phase; anything
#: it raises ends the producer and fails the run.
Score = Callable[[ScoredBatch], None]


class RolloutProducer:
    def __init__(
        self,
        generate: Generate,
        score: Score,
        *,
        max_staleness: int,
        last_step: int,
        stopped: Callable[[], bool],
        poll_seconds: float,
    ) -> None:
        """``poll_seconds``: how often waits look at the stop flags (``loop.stop_poll_seconds``)."""
        self._generate = generate
        self._score = score
        self._k = max_staleness
        self._last_step = last_step
        self._stopped = stopped
        self._poll_seconds = poll_seconds
        self._closed = threading.Event()
        self._cond = threading.Condition()
        self._ready: dict[int, ScoredBatch] = {}
        self._scoring: queue.Queue[ScoredBatch] = queue.Queue()
        self._failed: dict[int, ScoredBatch] = {}
        """Failed batches, by step, until the loop asks for them again."""
        self._halted = False
        """A failure was handed over: no new step starts before the loop's :meth:`retry`."""
        self._done = 0
        self._retry: int | None = None
        self._crash: BaseException | None = None
        self._threads: list[threading.Thread] = []

    # -- the loop's side -------------------------------------------------------------------------
    def start(self, first_step: int) -> None:
        """Produce from ``first_step`` on; ``first_step - 1`` steps are done."""
        self._done = first_step - 1
        self._threads = [
            threading.Thread(
                target=self._generating, args=(first_step,), name="rollout-producer", daemon=True
            ),
            threading.Thread(target=self._scoring_thread, name="rollout-scorer", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    @property
    def started(self) -> bool:
        return bool(self._threads)

    def take(self, step: int) -> ScoredBatch | None:
        """Step ``step``'s batch, waiting for it; None when the run stops first. A failed
        attempt raises its ``StepFailedError`` (then :meth:`retry`); a producer that crashed
        raises ``RunFailedError``."""
        with self._cond:
            while step not in self._ready:
                if self._crash is not None:
                    raise RunFailedError(
                        f"the rollout producer stopped: {type(self._crash).__name__}: {self._crash}"
                    ) from self._crash
                if self._is_stopped():
                    return None
                self._cond.wait(self._poll_seconds)
            batch = self._ready.pop(step)
            self._publish_fill()
        if batch.error is not None:
            raise batch.error
        return batch

    def retry(self, step: int) -> None:
        """Produce ``step`` again with the same prompts (its last attempt failed)."""
        with self._cond:
            self._retry = step
            self._cond.notify_all()

    def step_done(self, step: int) -> None:
        """Step ``step`` is trained (or trained nothing), its generators synced and aligned for
        the next step. The loop records the step after this, while the next batch may already
        be generating: a restart resumes after the last recorded step, so a batch started from
        an unrecorded step is drawn again, as every batch in the buffer is."""
        with self._cond:
            self._done = max(self._done, step)
            self._cond.notify_all()

    def close(self) -> None:
        self._closed.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def fill(self) -> tuple[int, int]:
        """(scored steps, scored groups) waiting in the buffer."""
        with self._cond:
            return len(self._ready), sum(len(b.data.items) for b in self._ready.values())

    # -- the producer's threads ------------------------------------------------------------------
    def _is_stopped(self) -> bool:
        return self._closed.is_set() or self._stopped()

    def _publish_fill(self) -> None:
        metrics.BUFFER_GROUPS.set(sum(len(b.data.items) for b in self._ready.values()))
        metrics.BUFFER_STEPS.set(len(self._ready))

    def _wait(self, ready: Callable[[], bool]) -> bool:
        """Wait (under the condition) until ``ready()``; False when the run stops first."""
        while not ready():
            if self._is_stopped():
                return False
            self._cond.wait(self._poll_seconds)
        return True

    def _put(self, batch: ScoredBatch) -> None:
        with self._cond:
            if batch.error is not None:
                log.warning("step %d: its batch failed: %s", batch.step, batch.error)
                self._failed[batch.step] = batch
                self._halted = True
            self._ready[batch.step] = batch
            self._publish_fill()
            self._cond.notify_all()

    def _crashed(self, err: BaseException) -> None:
        log.exception("rollout producer crashed")
        with self._cond:
            self._crash = err
            self._cond.notify_all()

    def _generating(self, step: int) -> None:
        """Generate the steps in order (a retry first), each once the bound lets it start."""

        def next_job() -> bool:
            if self._retry is not None:
                return True
            return (
                step <= self._last_step
                and not self._halted
                and may_start(step, self._done, self._k)
            )

        try:
            while True:
                with self._cond:
                    if not self._wait(next_job):
                        return
                    if self._retry is not None:
                        job, failed = self._retry, self._failed.pop(self._retry)
                        self._retry, self._halted = None, False
                    else:
                        job, failed = step, None
                        step += 1
                batch = self._generate(job, failed)
                if batch.error is not None:
                    self._put(batch)
                else:
                    self._scoring.put(batch)
        except BaseException as err:  # the loop fails the run with it (take raises)
            self._crashed(err)

    def _scoring_thread(self) -> None:
        """Score the generated batches in the order they were generated."""
        try:
            while not self._is_stopped():
                try:
                    batch = self._scoring.get(timeout=self._poll_seconds)
                except queue.Empty:
                    continue
                self._score(batch)
                self._put(batch)
        except BaseException as err:
            self._crashed(err)
