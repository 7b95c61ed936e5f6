"""One step of asynchronous mode (``loop.mode: async``; docs/controller.md, "Asynchronous
mode").

The producer (rollout/producer.py) draws, generates and scores the next steps, at most
``loop.max_staleness`` ahead, while the loop trains. Each step here takes its batch from the
producer, drops the groups older than ``max_staleness`` versions, trains it with the Train both
modes share (StepParts.train_batch), syncs the weights (each ApplyWeights holding the generator
gate, so weights reach the generators between their batches), aligns the next step (holding
the gate too), tells the producer the step is done, and records it while the next batch
generates. With ``loop.weight_apply: in_flight`` the sync and the align hold no gate: the
generators apply in the middle of the running batch. A failed batch is retried with the same
prompts, a Train answered "not applied" with the same batch.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from typing import Any

from podrl.controller import loop_metrics as metrics
from podrl.controller.records.recorder import StepRecord
from podrl.controller.rollout.gate import GeneratorGate
from podrl.controller.rollout.producer import (
    RolloutProducer,
    ScoredBatch,
)
from podrl.controller.service.status import RolloutView
from podrl.controller.step.batch import (
    StepSamples,
    check_score_errors,
    split_stale,
    with_stale_figures,
)
from podrl.controller.step.loop import StepParts
from podrl.controller.step_errors import RunFailedError, StepFailedError

log = logging.getLogger(__name__)


class AsyncSteps:
    """The :class:`~podrl.controller.step.loop.StepDriver` of asynchronous mode."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.config = parts.loop_config
        self.gate: GeneratorGate = parts.gate
        self.producer = RolloutProducer(
            self._generate,
            self._score,
            max_staleness=self.config.max_staleness,
            last_step=self.config.steps,
            stopped=parts.stopping,
            poll_seconds=self.config.stop_poll_seconds,
        )
        self.recorded_position: dict[str, Any] = {}
        """The task source's position after the last recorded step: where a checkpoint (or a
        restart) continues, the producer's source being ahead by the buffer's prompts."""
        self._needs_align = True
        self._retry_step: int | None = None
        self._taken: ScoredBatch | None = None
        """The batch of the step being trained, kept until recorded (a Train that was not
        applied is sent again with it)."""
        capacity = RolloutView.of(self.config).buffer_capacity_groups
        metrics.BUFFER_CAPACITY_GROUPS.set(capacity)

    def resumed(self) -> None:
        """After the loop's resume: the run's position and staleness totals so far."""
        self.recorded_position = self.parts.source.position()
        for record in self.parts.store.steps():  # the run's totals on /v1/status
            self.parts.state.count_staleness(record.metrics)

    def checkpoint_position(self) -> dict[str, Any]:
        """The producer's task source is ahead (the buffer's prompts): the position after the
        last recorded step is where a restart continues."""
        return self.recorded_position

    def failed(self) -> None:
        """The step's attempt failed: the next attempt aligns first and gets the same prompts
        (the producer regenerates a failed batch; a batch whose Train was not applied is sent
        again)."""
        self._needs_align = True

    def close(self) -> None:
        self.producer.close()

    # -- the producer's work (its threads) -------------------------------------------------------
    def _generate(self, step: int, failed: ScoredBatch | None) -> ScoredBatch:
        """Draw the step's prompts (or take those of the failed attempt) and generate them on
        the generating pods, holding the generator gate. A failed phase comes back as the
        batch's ``error``."""
        source = self.parts.source
        if failed is None:
            before = source.position()
            items = source.next_prompts(self.config.prompts_per_step)
            after = source.position()
        else:
            items, before, after = failed.data.items, failed.position_before, failed.position_after
        batch = ScoredBatch(step, StepSamples(items=list(items)), before, after)
        try:
            with self.gate.producer(self.parts.stopping) as held:
                if not held:
                    raise StepFailedError("generate", "the run is stopping")
                start = time.perf_counter()
                self.parts.phases.generate(
                    step,
                    batch.data,
                    self.config.sampling,
                    None,
                    self.parts.table.generating(),
                )
                batch.seconds["generate"] = round(time.perf_counter() - start, 4)
                metrics.PHASE_SECONDS.labels("generate").observe(batch.seconds["generate"])
        except StepFailedError as err:
            batch.error = err
        return batch

    def _score(self, batch: ScoredBatch) -> None:
        """Score a generated batch (no gate: the graders are not the generators)."""
        try:
            start = time.perf_counter()
            self.parts.phases.score(batch.data, self.parts.table.pods())
            batch.seconds["score"] = round(time.perf_counter() - start, 4)
            metrics.PHASE_SECONDS.labels("score").observe(batch.seconds["score"])
            check_score_errors(batch.data, self.config.max_score_error_rate)
        except StepFailedError as err:
            batch.error = err

    # -- the loop's step -------------------------------------------------------------------------
    def _align(self, expected: int) -> None:
        """A step boundary, holding the generator gate (between two batches); with
        ``loop.weight_apply: in_flight`` without it: its applies land in flight, a rollback
        takes the gate itself (WeightSync), and a batch already running keeps the pods it
        started with, as when a pod leaves mid-batch."""
        held = nullcontext() if self.parts.weights.in_flight else self.gate.loop()
        with held:
            self.parts.timed(
                "align", {}, lambda: self.parts.weights.align(self.parts.table, expected)
            )

    def run_step(self, attempt: int) -> StepRecord | None:
        parts = self.parts
        step = parts.state.step + 1
        expected = parts.state.policy_version
        timings: dict[str, float] = {}
        if self._needs_align:
            self._align(expected)
            self._needs_align = False
        if not self.producer.started:
            self.producer.start(step)
        elif self._retry_step == step:
            self.producer.retry(step)
        self._retry_step = None
        if self._taken is None or self._taken.step != step:
            try:
                scored = parts.timed("wait_for_batch", timings, lambda: self.producer.take(step))
            except StepFailedError:
                self._retry_step = step
                raise
            if scored is None:
                return None  # the run stops
            self._taken = scored
        scored = self._taken
        timings.update(scored.seconds)
        try:
            split = split_stale(scored.data, expected, self.config.max_staleness)
        except StepFailedError as err:  # the same batch would be refused again
            raise RunFailedError(
                f"step {step}: {err}; a generator serves a version its trainers never "
                "reached: restart the run to resume from its records and checkpoints"
            ) from err
        batch = with_stale_figures(parts.build_batch(split.fresh), split)
        trained = parts.train_batch(
            step,
            attempt,
            expected,
            batch,
            scored.data,
            scored.position_before,
            scored.position_after,
            timings,
        )
        parts.recorder.write_samples(step, scored.data, trained.sample_ids)
        # Each ApplyWeights holds the generator gate (WeightSync's `applying`; none in flight);
        # the publish before it overlaps the producer's batch. The step is done for the
        # producer once the generators are aligned for the next one; its record is written
        # while that batch runs.
        sync_seconds = parts.sync_weights(trained, timings)
        parts.table.note_syncs(trained.pods, trained.version, sync_seconds)
        if step < self.config.steps:
            try:
                self._align(trained.version)
            except StepFailedError as err:  # the next step aligns again at its start
                log.warning("align after step %d failed: %s", step, err)
                self._needs_align = True
        self.producer.step_done(step)
        record = parts.record(
            step, scored.position_after, scored.data, trained, timings, sync_seconds
        )
        self._taken = None
        self.recorded_position = scored.position_after
        self._count_staleness(record.metrics)
        return record

    def _count_staleness(self, figures: dict[str, Any]) -> None:
        for lag, groups in (figures.get("staleness_histogram") or {}).items():
            for _ in range(groups):
                metrics.GROUP_STALENESS.observe(int(lag))
        metrics.STALE_GROUPS_DROPPED.inc(figures.get("groups_dropped_stale") or 0)
        metrics.STALE_SAMPLES_DROPPED.inc(figures.get("samples_dropped_stale") or 0)
        metrics.SAMPLES_SPANNING_VERSIONS.inc(figures.get("samples_spanning_versions") or 0)
        self.parts.state.count_staleness(figures)
