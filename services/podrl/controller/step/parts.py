"""What one step is made of, shared by both step drivers.

:class:`StepParts` holds the run's collaborators and runs the parts of a step that synchronous
and asynchronous mode run alike: Train on every pod (``train_batch``), the weight sync
(``sync_weights``) and the step record (``record``). :class:`StepDriver` is what the loop
(``loop.py``) asks of a driver: ``sync_steps.SyncSteps`` draws, generates and scores each step
itself; ``async_steps.AsyncSteps`` takes each step's batch from the producer. Neither driver
knows the loop, and the loop knows no mode. Everything is built in one function,
``service/main.py``'s ``build_loop``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from podrl.common import faults
from podrl.config import RunConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.pods.roster import PodRoster
from podrl.controller.records.recorder import StepRecorder
from podrl.controller.records.run_store import PendingStep, RunStore, StepRecord
from podrl.controller.rollout.gate import GeneratorGate
from podrl.controller.service.status import RunState
from podrl.controller.step.batch import (
    StepBatchId,
    StepSamples,
    TrainBatch,
    build_batch,
    process_prefix,
    split_batch,
    train_request,
)
from podrl.controller.step.boundary import StepBoundary
from podrl.controller.step.phases import WorkerPhases
from podrl.controller.step.train_phase import TrainOutcome, TrainPhase
from podrl.controller.step.weight_sync import WeightSync
from podrl.controller.step_errors import StepFailedError
from podrl.tasks import TaskSource
from podrl.v1 import trainer_pb2

T = TypeVar("T")


class StepDriver(Protocol):
    """How the loop runs steps, whatever the mode."""

    def resumed(self) -> None:
        """The run's position is settled (after the resume at start): steps may run."""

    def run_step(self, attempt: int) -> StepRecord | None:
        """Attempt ``attempt`` of the next step: its record, or None when the run stops."""

    def failed(self) -> None:
        """The attempt failed and nothing of it was applied: the next attempt starts over
        with the same prompts."""

    def checkpoint_position(self) -> dict[str, Any]:
        """The task source's position after the last recorded step (where a checkpoint, and
        a restart from it, continues)."""

    def close(self) -> None:
        """The run ended: stop what the driver started."""


@dataclass(frozen=True)
class TrainedStep:
    """What Train made of a step's batch."""

    batch: TrainBatch
    batch_id: str
    outcome: TrainOutcome | None
    """None when the batch was empty (no group with a learning signal: trained: false)."""
    epoch: int
    """The roster's epoch the step was trained in."""
    version: int
    """The trainers' policy version after it."""

    @property
    def sample_ids(self) -> set[str]:
        """The samples the trainers trained on."""
        return {s.sample_id for s in self.batch.sequences} if self.outcome else set()


class StepParts:
    """The run's collaborators, and the parts of a step both drivers run."""

    def __init__(
        self,
        config: RunConfig,
        state: RunState,
        store: RunStore,
        source: TaskSource,
        roster: PodRoster,
        phases: WorkerPhases,
        train_phase: TrainPhase,
        weights: WeightSync,
        boundary: StepBoundary,
        recorder: StepRecorder,
        gate: GeneratorGate,
        pool: ThreadPoolExecutor,
        stop: threading.Event,
    ) -> None:
        self.config = config
        self.loop_config = config.loop
        self.state = state
        self.store = store
        self.source = source
        self.roster = roster
        self.phases = phases
        self.train_phase = train_phase
        self.weights = weights
        self.boundary = boundary
        self.recorder = recorder
        self.gate = gate
        """Who may use the generators; only async mode's producer contends for it."""
        self.pool = pool
        self.stop = stop
        """Set to stop the run: the step in flight ends (its retries end early)."""
        self.ended = threading.Event()
        """Set when the loop has ended, stopped or not: async mode's producer ends too."""
        self.batch_prefix = process_prefix(config.name)

    def stopping(self) -> bool:
        return self.ended.is_set() or self.stop.is_set()

    def timed(self, phase: str, timings: dict[str, float], fn: Callable[[], T]) -> T:
        self.state.set_phase(phase)
        start = time.perf_counter()
        try:
            return fn()
        finally:
            timings[phase] = round(time.perf_counter() - start, 4)
            metrics.PHASE_SECONDS.labels(phase).observe(timings[phase])

    def seed_for(self, step: int) -> int | None:
        seed = self.loop_config.sample_seed
        return None if seed is None else seed + step

    def build_batch(self, data: StepSamples) -> TrainBatch:
        return build_batch(
            data,
            normalize_std=self.loop_config.normalize_advantages_std,
            min_valid_per_group=self.loop_config.min_valid_samples_per_group,
        )

    def train_batch(
        self,
        step: int,
        attempt: int,
        expected: int,
        batch: TrainBatch,
        data: StepSamples,
        position_before: dict[str, Any],
        position_after: dict[str, Any],
        timings: dict[str, float],
    ) -> TrainedStep:
        """Train the step's batch on every pod at once."""
        step_batch = StepBatchId(self.batch_prefix, step, attempt)
        batch_id = str(step_batch)
        if not batch.sequences:
            return TrainedStep(batch, batch_id, None, self.roster.epoch, expected)
        trainers = self.boundary.train_set()
        if not trainers:
            raise StepFailedError("train", "no pod is left to train on")

        def requests_for(pod_ids: list[str], round_no: int) -> dict[str, trainer_pb2.TrainRequest]:
            # Every round of this step shares the prefix recorded as the step in flight:
            # a restart recognises any of them in a trainer's last_batch_id.
            shares = split_batch(batch.sequences, pod_ids)
            self.roster.note_shares(sequences={p: len(s) for p, s in shares.items()})
            return {
                pod_id: train_request(
                    shares[pod_id],
                    batch,
                    expected,
                    step_batch.for_pod(round_no, pod_id),
                    pods=len(pod_ids),
                    pod_ids=pod_ids,
                )
                for pod_id in pod_ids
            }

        if self.loop_config.generator_memory == "sleep_during_train":
            # The trainers get the generators' accelerator memory while they train;
            # sync_weights wakes the generators again (or the retry's align does).
            self.timed("sleep", timings, lambda: self.weights.sleep_pods(self.roster.pods()))
        self.store.set_pending(
            PendingStep(step, position_before, position_after, [i.id for i in data.items], batch_id)
        )
        outcome = self.timed(
            "train",
            timings,
            lambda: self.train_phase.train_pods(trainers, expected, requests_for),
        )
        faults.hit("controller.after_train", step=step)
        return TrainedStep(
            batch, batch_id, outcome, self.roster.epoch, outcome.reply.policy_version
        )

    def sync_weights(
        self, outcome: TrainOutcome | None, version: int, timings: dict[str, float]
    ) -> dict[str, float]:
        """Each pod that trained the step syncs its generator to ``version``: pod → seconds."""
        if outcome is None:
            return {}
        # Joining pods' generators get a full manifest (their first sync); their trainers
        # hold the run's version now, so they stop joining.
        joining = self.roster.joining()
        self.roster.note_trained(dict.fromkeys(outcome.replies, version))
        synced = [pod for pod in self.roster.pods() if pod.id in outcome.replies]
        lost = self.boundary.lost
        if self.loop_config.generator_memory == "sleep_during_train":
            woken = self.timed(
                "wake",
                timings,
                lambda: self.weights.wake_pods(
                    synced, self.loop_config.max_step_attempts, is_lost=lost
                ),
            )
            for pod in [pod for pod in synced if pod.id not in woken]:
                self.roster.drop(pod.id, "lost while its generator woke")
                synced.remove(pod)
        sync_seconds = self.timed(
            "sync",
            timings,
            lambda: self.weights.sync_pods(
                synced,
                version,
                self.loop_config.max_step_attempts,
                is_lost=lost,
                align=joining,
            ),
        )
        for pod in synced:
            if pod.id in sync_seconds:
                self.roster.note_synced(pod, version)
            else:
                self.roster.drop(pod.id, "lost during the weight sync")
        return sync_seconds

    def record(
        self,
        step: int,
        position_after: dict[str, Any],
        data: StepSamples,
        trained: TrainedStep,
        timings: dict[str, float],
        sync_seconds: dict[str, float],
    ) -> StepRecord:
        return self.recorder.record(
            step,
            trained.version,
            position_after,
            data,
            trained.batch,
            trained.outcome,
            trained.batch_id,
            timings,
            epoch=trained.epoch,
            sync_seconds=sync_seconds,
        )
