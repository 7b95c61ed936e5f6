"""The GRPO loop the controller runs: it sequences the parts, each in its module.

One step (docs/controller.md), over the pods the pod table admits at its start (pods/table.py):

    step boundary: admit pods, align their generators (pod_calls) → draw prompts →
    generate and score, each pod its share (pod_calls) → batch over the whole step (batch) →
    Train on every pod at once, each its share (pod_calls) → samples.jsonl → weight sync
    inside each pod (pod_calls) → step record (recorder)

The loop runs the steps through a step driver (``StepDriver``): ``SyncSteps`` (here) runs
one step after the other; in async mode (``loop.mode: async``) async_steps.py takes each step's
batch from a producer that generates and scores ahead while the trainers train. Both share the
Train, the sync and the record (``StepParts``, here). ``GrpoLoop`` adds what is the same in
both modes: retries, a trainer checkpoint every ``loop.checkpoint_every`` steps and at the end,
the resume at start (records/checkpointing), held-out evaluations (records/evaluation). The
loop knows no mode (it names no driver) and neither driver knows the loop; everything is built
in one function, ``service/main.py``'s ``build_loop``.

With ``loop.generator_memory: sleep_during_train`` the generators sleep just before Train and
wake just before the weight sync (pod_calls: sleep_pods, wake_pods; align wakes any left
asleep by a failed attempt).

Failure rules:
- a pod lost or drained mid-step leaves the admitted pods; what it returned is kept and the rest of
  its share is done by the other pods in the same step (pod_calls);
- generate / score fail otherwise, too many score errors, or Train answered "not applied": the
  attempt is thrown away whole and the step is retried from the same data position (the same
  prompts), up to ``loop.max_step_attempts``; then the run fails.
- Train's outcome unknown (lost reply, timeout): the same requests are re-sent, never a new
  batch (pod_calls); a step is never applied twice.
- sync fails: the trainers already hold the new version, so only the sync is retried.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import grpc

from podrl.common import faults
from podrl.config import RunConfig
from podrl.config.loop import SamplingConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.pods.table import Pod, PodTable
from podrl.controller.records.checkpointing import RunCheckpoints
from podrl.controller.records.evaluation import Evaluator, RunPhases
from podrl.controller.records.recorder import PendingStep, RunStore, StepRecord, StepRecorder
from podrl.controller.rollout.gate import GeneratorGate
from podrl.controller.service.status import RunState
from podrl.controller.step.batch import (
    StepBatchId,
    StepSamples,
    TrainBatch,
    build_batch,
    check_score_errors,
    process_prefix,
    split_batch,
    train_request,
)
from podrl.controller.step.pod_calls import TrainOutcome, TrainPhase, WeightSync, WorkerPhases
from podrl.controller.step_errors import (
    RunFailedError,
    StepFailedError,
    describe_rpc_error,
)
from podrl.tasks import TaskSource
from podrl.v1 import trainer_pb2

T = TypeVar("T")

log = logging.getLogger(__name__)


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
    """The pod table's epoch the step was trained in."""
    version: int
    """The trainers' policy version after it."""
    pods: tuple[Pod, ...] = ()
    """The admitted pods whose trainers applied it: their generators sync to ``version``."""
    joining: frozenset[str] = frozenset()
    """Those of ``pods`` that joined at this step: their generators get a full manifest."""

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
        table: PodTable,
        phases: WorkerPhases,
        train_phase: TrainPhase,
        weights: WeightSync,
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
        self.table = table
        self.phases = phases
        self.train_phase = train_phase
        self.weights = weights
        self.recorder = recorder
        self.gate = gate
        """Who may use the generators; only async mode's producer contends for it."""
        self.pool = pool
        self.stop = stop
        """Set to stop the run: the step in flight ends (its retries end early)."""
        self.ended = threading.Event()
        """Set when the loop has ended, stopped or not: async mode's producer ends too."""
        self.phase = "idle"
        """The run's phase: the step's part running now, or where the run stands (status
        reads it: RunState.follow_loop). One thread writes it at a time, a string whole."""
        self.batch_prefix = process_prefix(config.name)

    def stopping(self) -> bool:
        return self.ended.is_set() or self.stop.is_set()

    def timed(self, phase: str, timings: dict[str, float], fn: Callable[[], T]) -> T:
        self.phase = phase
        start = time.perf_counter()
        try:
            return fn()
        finally:
            timings[phase] = round(time.perf_counter() - start, 4)
            metrics.PHASE_SECONDS.labels(phase).observe(timings[phase])

    def build_batch(self, data: StepSamples) -> TrainBatch:
        return build_batch(
            data,
            normalize_std=self.loop_config.normalize_advantages_std,
            min_valid_per_group=self.loop_config.min_valid_samples_per_group,
            keep_equal_reward_groups=self.loop_config.keep_equal_reward_groups,
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
            return TrainedStep(batch, batch_id, None, self.table.epoch, expected)
        trainers = self.table.train_set()
        if not trainers:
            raise StepFailedError("train", "no pod is left to train on")

        def requests_for(pod_ids: list[str], round_no: int) -> dict[str, trainer_pb2.TrainRequest]:
            # Every round of this step shares the prefix recorded as the step in flight:
            # a restart recognises any of them in a trainer's last_batch_id.
            shares = split_batch(batch.sequences, pod_ids)
            self.table.note_shares(sequences={p: len(s) for p, s in shares.items()})
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
            self.timed("sleep", timings, lambda: self.weights.sleep_pods(self.table.pods()))
        self.store.set_pending(
            PendingStep(step, position_before, position_after, [i.id for i in data.items], batch_id)
        )
        outcome = self.timed(
            "train",
            timings,
            lambda: self.train_phase.train_pods(trainers, expected, requests_for),
        )
        if faults.ARMED:
            faults.hit("controller.after_train", step=step)
        version = outcome.reply.policy_version
        # Joining pods' generators get a full manifest (their first sync); their trainers
        # hold the run's version now, so they stop joining.
        joining = self.table.joining()
        self.table.note_trained(dict.fromkeys(outcome.replies, version))
        pods = tuple(pod for pod in self.table.pods() if pod.id in outcome.replies)
        return TrainedStep(batch, batch_id, outcome, self.table.epoch, version, pods, joining)

    def sync_weights(self, trained: TrainedStep, timings: dict[str, float]) -> dict[str, float]:
        """Each pod that trained the step syncs its generator to the trained version: pod →
        seconds. The pod table is neither read nor written on the way (the driver notes the
        outcome after it: ``PodTable.note_syncs``); only a pod lost meanwhile is asked about."""
        if trained.outcome is None:
            return {}
        version = trained.version
        synced = list(trained.pods)
        lost = self.table.lost
        if self.loop_config.generator_memory == "sleep_during_train":
            woken = self.timed(
                "wake",
                timings,
                lambda: self.weights.wake_pods(
                    synced, self.loop_config.max_step_attempts, is_lost=lost
                ),
            )
            for pod in [pod for pod in synced if pod.id not in woken]:
                self.table.drop(pod.id, "lost while its generator woke")
                synced.remove(pod)
        sync_seconds = self.timed(
            "sync",
            timings,
            lambda: self.weights.sync_pods(
                synced,
                version,
                self.loop_config.max_step_attempts,
                is_lost=lost,
                align=trained.joining,
            ),
        )
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


class SyncSteps:
    """The :class:`~podrl.controller.step.loop.StepDriver` of synchronous mode."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self._position_before: dict[str, Any] | None = None
        """The task source's position before the attempt running (a failed attempt goes back
        to it: the retry gets the same prompts)."""

    def resumed(self) -> None:
        """Nothing to start: each step draws its own prompts."""

    def checkpoint_position(self) -> dict[str, Any]:
        return self.parts.source.position()

    def failed(self) -> None:
        if self._position_before is not None:
            self.parts.source.restore(self._position_before)  # the same prompts, nothing kept

    def close(self) -> None:
        """Nothing runs between steps."""

    def run_step(self, attempt: int) -> StepRecord | None:
        parts = self.parts
        config = parts.loop_config
        step = parts.state.step + 1
        expected = parts.state.policy_version
        position_before = self._position_before = parts.source.position()
        timings: dict[str, float] = {}
        generating = parts.timed("align", {}, lambda: parts.weights.align(parts.table, expected))
        data = StepSamples(items=parts.source.next_prompts(config.prompts_per_step))
        position_after = parts.source.position()
        parts.timed(
            "generate",
            timings,
            lambda: parts.phases.generate(step, data, config.sampling, expected, generating),
        )
        parts.timed("score", timings, lambda: parts.phases.score(data, parts.table.pods()))
        check_score_errors(data, config.max_score_error_rate)
        batch = parts.build_batch(data)
        trained = parts.train_batch(
            step, attempt, expected, batch, data, position_before, position_after, timings
        )
        parts.recorder.write_samples(step, data, trained.sample_ids)
        sync_seconds = parts.sync_weights(trained, timings)
        parts.table.note_syncs(trained.pods, trained.version, sync_seconds)
        return parts.record(step, position_after, data, trained, timings, sync_seconds)


class GrpoLoop:
    def __init__(
        self,
        parts: StepParts,
        driver: StepDriver,
        checkpoints: RunCheckpoints,
        evaluator: Evaluator,
    ) -> None:
        self.parts = parts
        self.driver = driver
        self.checkpoints = checkpoints
        self.evaluator = evaluator  # held-out prompts, drawn apart from the run's task source
        self.loop_config = parts.loop_config
        self.state = parts.state
        self.store = parts.store
        self.recorder = parts.recorder

    def _wait_for_workers(self) -> None:
        stop = self.parts.stop
        deadline = time.monotonic() + self.loop_config.workers_timeout_seconds
        while not self.state.is_ready():
            if stop.is_set():
                return
            if time.monotonic() > deadline:
                raise RunFailedError(
                    f"fewer than {self.state.min_worker_pods} healthy worker pods after "
                    f"{self.loop_config.workers_timeout_seconds:.0f}s "
                    "(loop.workers_timeout_seconds)"
                )
            self.parts.phase = "waiting_for_workers"
            stop.wait(0.2)

    # -- one step --------------------------------------------------------------------------------
    def run_step_with_retries(self) -> StepRecord | None:
        stop = self.parts.stop
        attempts = self.loop_config.max_step_attempts
        for attempt in range(1, attempts + 1):
            try:
                return self.driver.run_step(attempt)
            except StepFailedError as err:
                # Nothing of the attempt was applied (a Train of unknown outcome never ends up
                # here: it raises RunFailedError and keeps the step in flight for a restart).
                metrics.STEP_FAILURES.labels(err.phase).inc()
                self.driver.failed()
                self.store.clear_pending()
                log.error(
                    "step %d attempt %d/%d failed in %s",
                    self.state.step + 1,
                    attempt,
                    attempts,
                    err,
                )
                self.state.set_error(str(err))
                if attempt == attempts:
                    raise RunFailedError(
                        f"step {self.state.step + 1} failed {attempt} times; last error: {err}"
                    ) from err
                stop.wait(min(2.0 * attempt, 10.0))
                self._wait_for_workers()
                if stop.is_set():
                    return None
        return None

    # -- checkpoints, held-out evaluation and the export ------------------------------------------
    def checkpoint(self) -> str:
        return self.checkpoints.save(self.driver.checkpoint_position())

    def _eval_phases(self, step: int) -> RunPhases:
        parts = self.parts

        def run(data: StepSamples, sampling: SamplingConfig) -> None:
            version = self.state.policy_version
            with parts.gate.loop():  # async mode: between two of the producer's batches
                pods = parts.weights.align(parts.table, version)
                parts.phases.generate(step, data, sampling, version, pods)
            parts.phases.score(data, parts.table.pods())

        return run

    def _eval_due(self, step: int, when: str) -> bool:
        """Whether an evaluation belongs after ``step`` (0: before the first step): with
        ``loop.eval_prompts``, then, every ``loop.eval_every``-th step and at the end. Decided
        here, from the config, so that a step after which none is due runs no evaluation code."""
        config = self.loop_config
        if config.eval_prompts <= 0:
            return False
        return (
            when == "final"
            or step == 0
            or bool(config.eval_every and step % config.eval_every == 0)
        )

    def evaluate_after(self, step: int, when: str) -> None:
        """The evaluation that belongs after ``step`` (0 = before the first), unless it is
        recorded already (a resumed run). It never trains and never draws from the run's
        task source."""
        stop = self.parts.stop
        if stop.is_set() or not self._eval_due(step, when) or self.recorder.has_eval_after(step):
            return
        version = self.state.policy_version
        record = self.parts.timed(
            "evaluate",
            {},
            lambda: self.evaluator.evaluate(
                step, version, when, self._eval_phases(step), stop.wait
            ),
        )
        self.recorder.record_eval(record)

    # -- the whole run -----------------------------------------------------------------------------
    def run(self) -> None:
        """The run, until its last step, a failure, or ``parts.stop``."""
        stop = self.parts.stop
        timed = self.parts.timed
        try:
            self._wait_for_workers()
            if stop.is_set():
                return
            self.checkpoints.resume()
            self.driver.resumed()
            self.evaluate_after(self.state.step, "initial" if not self.state.step else "periodic")
            while self.state.step < self.loop_config.steps and not stop.is_set():
                record = self.run_step_with_retries()
                if record is None:
                    break
                every = self.loop_config.checkpoint_every
                if every and record.step % every == 0:
                    timed("checkpoint", {}, self.checkpoint)
                self.evaluate_after(record.step, "periodic")
            if self.state.step > 0 and self.store.get("checkpoint", {}).get("step") != (
                self.state.step
            ):
                timed("checkpoint", {}, self.checkpoint)
            finished = self.state.step >= self.loop_config.steps
            if finished:
                self.evaluate_after(self.state.step, "final")
                if self.loop_config.export_at_end:
                    timed("export", {}, self.checkpoints.export)
            self.parts.phase = "finished" if finished else "stopped"
            self.recorder.write_summary()
        except (RunFailedError, StepFailedError) as err:
            self._fail(str(err))
        except grpc.RpcError as err:
            self._fail(f"unexpected RPC failure: {describe_rpc_error(err)}")
        except Exception as err:  # the status page must say the loop is dead, and why
            log.exception("GRPO loop crashed")
            self._fail(f"loop crashed: {type(err).__name__}: {err}")
        finally:
            self.parts.ended.set()
            self.driver.close()
            self.parts.pool.shutdown(wait=False, cancel_futures=True)
            self.recorder.close()

    def _fail(self, error: str) -> None:
        log.error("run failed: %s", error)
        self.state.set_error(error)
        self.parts.phase = "failed"
        self.recorder.write_summary()
