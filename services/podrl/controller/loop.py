"""The GRPO loop the controller runs: it sequences the parts, each in its module.

One step (docs/controller.md), over the pods the roster admits at its start (roster.py):

    admit pods, align their generators → draw prompts → generate and score, each pod its share
    (phases) → batch over the whole step (batch) → Train on every pod at once, each its share
    (train_phase) → samples.jsonl → weight sync inside each pod (weight_sync) → step record
    (recorder)

and a trainer checkpoint every ``loop.checkpoint_every`` steps and at the end (one pod's
trainer writes it: every replica holds the same weights). At start, and after a restart,
``resume`` decides where the run continues.

With ``loop.generator_memory: sleep_during_train`` the generators sleep just before Train and
wake just before the weight sync (weight_sync: sleep_pods, wake_pods; align wakes any left
asleep by a failed attempt).

Failure rules:
- a pod lost or drained mid-step leaves the roster; what it returned is kept and the rest of
  its share is done by the other pods in the same step (phases, train_phase);
- generate / score fail otherwise, too many score errors, or Train answered "not applied": the
  attempt is thrown away whole and the step is retried from the same data position (the same
  prompts), up to ``loop.max_step_attempts``; then the run fails.
- Train's outcome unknown (lost reply, timeout): the same requests are re-sent, never a new
  batch (train_phase); a step is never applied twice.
- sync fails: the trainers already hold the new version, so only the sync is retried.

Async mode (``loop.mode: async``, rollout_buffer.py): a producer thread draws, generates and
scores the next steps (at most ``loop.max_staleness`` ahead) while this loop trains; each step
takes its batch from the producer, drops groups older than ``max_staleness`` versions, trains
as above, then syncs (each ApplyWeights holding the generator gate, so weights reach the
generators between their batches), aligns the next step (holding it too) and records. A
failed batch is retried with the same prompts, a Train answered "not applied" with the same
batch.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, TypeVar

import grpc

from podrl.common import faults
from podrl.config import RunConfig
from podrl.config.loop import SamplingConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.batch import (
    StepSamples,
    TrainBatch,
    build_batch,
    check_score_errors,
    split_batch,
    split_stale,
    train_request,
    with_stale_figures,
)
from podrl.controller.checkpoint_files import checkpoint_folder, newest_checkpoint
from podrl.controller.clients import WorkerClients
from podrl.controller.evaluation import Evaluator, RunPhases
from podrl.controller.phases import WorkerPhases, settle
from podrl.controller.recorder import StepRecorder
from podrl.controller.resume import (
    ControllerState,
    TrainerState,
    choose_checkpoint,
    plan_resume,
)
from podrl.controller.rollout_buffer import (
    GeneratorGate,
    RolloutProducer,
    ScoredBatch,
    buffer_capacity_steps,
)
from podrl.controller.roster import Pod, PodRoster, pod_order
from podrl.controller.run_store import PendingStep, RunStore, StepRecord
from podrl.controller.status import RolloutView, RunState
from podrl.controller.step_errors import (
    RunFailedError,
    StepFailedError,
    describe_rpc_error,
)
from podrl.controller.train_phase import TrainOutcome, TrainPhase
from podrl.controller.weight_sync import WeightSync
from podrl.tasks import TaskSource
from podrl.v1 import controller_pb2, trainer_pb2

log = logging.getLogger(__name__)
T = TypeVar("T")


class GrpoLoop:
    def __init__(
        self,
        config: RunConfig,
        state: RunState,
        store: RunStore,
        clients: WorkerClients,
        source: TaskSource,
        roster: PodRoster | None = None,
    ) -> None:
        self.config = config
        self.loop_config = config.loop
        self.state = state
        self.store = store
        self.clients = clients
        self.source = source
        self.roster = roster or state.roster or PodRoster(state.registry)
        state.roster = self.roster
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="loop-rpc")
        self.phases = WorkerPhases(clients, self._pool, state.registry, self.roster)
        self.train_phase = TrainPhase(clients, config.loop.max_step_attempts, pool=self._pool)
        self.train_phase.on_lost = self._trainer_lost
        # Asynchronous mode (loop.mode: async; rollout_buffer.py).
        self.asynchronous = config.loop.mode == "async"
        self.gate = GeneratorGate()
        self.weights = WeightSync(
            clients, self._pool, applying=self.gate.loop if self.asynchronous else nullcontext
        )
        self.recorder = StepRecorder(config, state, store)
        self.evaluator = Evaluator(config)  # held-out prompts, drawn apart from self.source
        # Batch ids name this controller process too: one restarted never reuses an id that
        # a trainer may still hold as its last applied batch.
        self._batch_prefix = f"{config.name}:{uuid.uuid4().hex[:8]}"
        self._joining: set[str] = set()
        self._replicas: dict[str, str] = {}
        """Pod id → the incarnation of its trainer process last sent a Train (a torchft
        replica heartbeating to the Lighthouse)."""
        self._seen: dict[str, Pod] = {}
        """Each pod as last admitted: a pod whose processes changed gets new channels."""
        self._synced: dict[str, tuple[Pod, int]] = {}
        """Pod id → (the pod, the version) of each sync that succeeded since the last align:
        its trainer published that version and its generator applied it, so the next align
        need not ask them again (one align reads and clears it: a retry's align asks all)."""
        self._recorded_position: dict[str, Any] = {}
        """The task source's position after the last recorded step (set by resume)."""
        self._producer_stopped = threading.Event()
        self._run_stop = threading.Event()
        self.producer = RolloutProducer(
            self._produce,
            max_staleness=config.loop.max_staleness if self.asynchronous else 0,
            last_step=config.loop.steps,
            stopped=self._stopping,
        )
        self._generating: list[Pod] = []
        """The pods whose generators the producer uses (set by each align)."""
        self._needs_align = True
        self._retry_step: int | None = None
        self._taken: ScoredBatch | None = None
        """The batch of the step being trained, kept until recorded (a Train that was not
        applied is sent again with it)."""
        if self.asynchronous:
            capacity = (
                buffer_capacity_steps(config.loop.max_staleness) * config.loop.prompts_per_step
            )
            state.buffer_fill = self.producer.fill
            state.set_rollout(
                RolloutView(
                    mode="async",
                    max_staleness=config.loop.max_staleness,
                    buffer_capacity_groups=capacity,
                )
            )
            metrics.BUFFER_CAPACITY_GROUPS.set(capacity)

    # -- workers ---------------------------------------------------------------------------------
    def _lead(self) -> Pod:
        """The pod whose trainer writes checkpoints and answers for the run at resume: the
        first (by ordinal) that is not still joining."""
        pods = self.roster.pods() or self.roster.admit()
        ready = [pod for pod in pods if pod.id not in self._joining]
        if not ready:
            raise StepFailedError("train", "no healthy trainer is registered")
        return ready[0]

    def _trainer_lost(self, pod_id: str, reason: str) -> None:
        """A pod whose trainer stopped answering mid-step leaves; it comes back (and heals)
        when its trainer heartbeats or registers again."""
        for pod in self.roster.pods():
            if pod.id == pod_id:
                self.state.registry.mark_unreachable(pod.trainer)
        self.roster.drop(pod_id, reason)

    def _train_set(self) -> dict[str, str]:
        """Pod id → trainer address of every trainer this step's Train goes to: each healthy
        trainer of the roster's pods, and every other healthy trainer process that has trained
        in this run (a pod that lost its generator or grader mid-step, say). torchft's
        Lighthouse counts the trainers that heartbeat to it (from their first Train on), and
        one that is not sent a step holds the others' quorum until its timeout
        (docs/scaling.md, "Trainers across pods"); an empty share is fine. A trainer that is
        draining or gone is left out (its pod leaves the roster)."""
        healthy = self.state.registry.healthy_members(controller_pb2.COMPONENT_TRAINER)
        terminating = self.roster.terminating()
        trainers: dict[str, str] = {}
        for pod in self.roster.pods():
            member = healthy.get(pod.id)
            if member is None or member.incarnation != pod.incarnations[0] or pod.id in terminating:
                self.roster.drop(pod.id, "its trainer is draining, terminating or gone")
            else:
                trainers[pod.id] = pod.trainer
        for pod_id, member in healthy.items():
            if self._replicas.get(pod_id) == member.incarnation and pod_id not in terminating:
                trainers.setdefault(pod_id, member.address)
        for pod_id in trainers:
            self._replicas[pod_id] = healthy[pod_id].incarnation
        return {pod_id: trainers[pod_id] for pod_id in sorted(trainers, key=pod_order)}

    def _lost(self, pod: Pod) -> bool:
        return not self.roster.usable(pod)

    def _wait_for_workers(self, stop: threading.Event) -> None:
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
            self.state.set_phase("waiting_for_workers")
            stop.wait(0.2)

    def _timed(self, phase: str, timings: dict[str, float], fn: Callable[[], T]) -> T:
        self.state.set_phase(phase)
        start = time.perf_counter()
        try:
            return fn()
        finally:
            timings[phase] = round(time.perf_counter() - start, 4)
            metrics.PHASE_SECONDS.labels(phase).observe(timings[phase])

    def _trainer_versions(self, pods: list[Pod]) -> dict[str, int]:
        """Each pod's trainer version (Info); a pod whose trainer does not answer leaves."""
        infos = settle(
            self._pool, [lambda p=p: self.train_phase.trainer_info(p.trainer) for p in pods]
        )
        versions = {}
        for pod, info in zip(pods, infos, strict=True):
            if isinstance(info, trainer_pb2.TrainerInfo):
                versions[pod.id] = info.policy_version
            else:
                self.state.registry.mark_unreachable(pod.trainer)
                self.roster.drop(pod.id, f"trainer {pod.trainer} does not answer Info")
        return versions

    def align(self, expected: int) -> list[Pod]:
        """A step boundary: admit the pods, tell the joining ones (their trainer is behind and
        heals from a peer inside its first Train; their generator is synced after it), and
        bring every other pod's generator to ``expected``. The pods that generate."""
        pods = self.roster.admit()
        if not pods:
            raise StepFailedError("align", "no complete, healthy worker pod is registered")
        for pod in pods:
            before = self._seen.get(pod.id)
            if before is not None and before != pod:  # a process restarted: fresh channels
                for address in {before.trainer, before.generator, before.grader}:
                    self.clients.forget(address)
            self._seen[pod.id] = pod
        synced, self._synced = self._synced, {}
        settled = {pod.id for pod in pods if synced.get(pod.id) == (pod, expected)}
        versions = self._trainer_versions([pod for pod in pods if pod.id not in settled])
        versions |= dict.fromkeys(settled, expected)
        ahead = {pod: v for pod, v in versions.items() if v > expected}
        if ahead:
            raise RunFailedError(
                f"the trainers of pods {sorted(ahead)} are at policy versions "
                f"{sorted(set(ahead.values()))}, ahead of the run's {expected}; restart the run "
                "to resume from its records and checkpoints"
            )
        self.roster.note_versions(versions, expected)
        self._joining = {pod for pod, v in versions.items() if v < expected}
        ready = [pod for pod in self.roster.pods() if pod.id not in self._joining]
        if not ready and versions:
            pod, version = next(iter(versions.items()))
            raise RunFailedError(
                f"the trainer of pod {pod} is at policy version {version} (expected {expected})"
                f" and no trainer holds version {expected} to heal it from; restart the run to "
                "resume from its records and checkpoints"
            )
        if self._joining:
            log.info(
                "pods %s join at version %d: their trainers heal from a peer in this step's Train",
                sorted(self._joining),
                expected,
            )
        # A generator that restarted, or missed a sync while it was unreachable, is brought
        # to the trainer's version first: its samples would be refused otherwise.
        unsettled = [pod for pod in ready if pod.id not in settled]
        outcomes = settle(
            self._pool,
            [lambda p=p: self.weights.bring_generator_to(p, expected) for p in unsettled],
        )
        for pod, outcome in zip(unsettled, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, StepFailedError) or not self._lost(pod):
                    raise outcome
                self.roster.drop(pod.id, f"align: {outcome}")
        return [pod for pod in self.roster.pods() if pod.id not in self._joining]

    # -- one step --------------------------------------------------------------------------------
    def run_step(self, attempt: int) -> StepRecord | None:
        if self.asynchronous:
            return self.run_step_async(attempt)
        config = self.loop_config
        step = self.state.step + 1
        expected = self.state.policy_version
        position_before = self.source.position()
        timings: dict[str, float] = {}
        generating = self._timed("align", {}, lambda: self.align(expected))
        data = StepSamples(items=self.source.next_prompts(config.prompts_per_step))
        position_after = self.source.position()
        seed = self._seed(step)
        self._timed(
            "generate",
            timings,
            lambda: self.phases.generate(step, data, config.sampling, seed, expected, generating),
        )
        self._timed("score", timings, lambda: self.phases.score(data, self.roster.pods()))
        check_score_errors(data, config.max_score_error_rate)
        batch = self._build_batch(data)
        batch_id, outcome, epoch = self._train(
            step, attempt, expected, batch, data, position_before, position_after, timings
        )
        version = outcome.reply.policy_version if outcome else expected
        trained_ids = {s.sample_id for s in batch.sequences} if outcome else set()
        self.recorder.write_samples(step, data, trained_ids)
        sync_seconds = self._sync(outcome, version, timings)
        return self.recorder.record(
            step,
            version,
            position_after,
            data,
            batch,
            outcome,
            batch_id,
            timings,
            epoch=epoch,
            sync_seconds=sync_seconds,
        )

    def _seed(self, step: int) -> int | None:
        seed = self.loop_config.sample_seed
        return None if seed is None else seed + step

    def _build_batch(self, data: StepSamples) -> TrainBatch:
        return build_batch(
            data,
            normalize_std=self.loop_config.normalize_advantages_std,
            min_valid_per_group=self.loop_config.min_valid_samples_per_group,
        )

    def _train(
        self,
        step: int,
        attempt: int,
        expected: int,
        batch: TrainBatch,
        data: StepSamples,
        position_before: dict[str, Any],
        position_after: dict[str, Any],
        timings: dict[str, float],
    ) -> tuple[str, TrainOutcome | None, int]:
        """Train the step's batch on every pod at once: (batch id, outcome, epoch); the outcome
        is None when the batch is empty (no group with a learning signal: trained: false)."""
        batch_id = f"{self._batch_prefix}:{step}:{attempt}"
        epoch = self.roster.epoch
        if not batch.sequences:
            return batch_id, None, epoch
        trainers = self._train_set()
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
                    f"{batch_id}.{round_no}@{pod_id}",
                    pods=len(pod_ids),
                )
                for pod_id in pod_ids
            }

        if self.loop_config.generator_memory == "sleep_during_train":
            # The trainers get the generators' accelerator memory while they train; _sync
            # wakes the generators again (or the retry's align does, if this attempt fails).
            self._timed("sleep", timings, lambda: self.weights.sleep_pods(self.roster.pods()))
        self.store.set_pending(
            PendingStep(step, position_before, position_after, [i.id for i in data.items], batch_id)
        )
        outcome = self._timed(
            "train",
            timings,
            lambda: self.train_phase.train_pods(trainers, expected, requests_for),
        )
        faults.hit("controller.after_train", step=step)
        return batch_id, outcome, self.roster.epoch

    def _sync(
        self, outcome: TrainOutcome | None, version: int, timings: dict[str, float]
    ) -> dict[str, float]:
        """Each pod that trained the step syncs its generator to ``version``: pod → seconds."""
        if outcome is None:
            return {}
        self.roster.note_trained(dict.fromkeys(outcome.replies, version))
        synced = [pod for pod in self.roster.pods() if pod.id in outcome.replies]
        if self.loop_config.generator_memory == "sleep_during_train":
            woken = self._timed(
                "wake",
                timings,
                lambda: self.weights.wake_pods(
                    synced, self.loop_config.max_step_attempts, is_lost=self._lost
                ),
            )
            for pod in [pod for pod in synced if pod.id not in woken]:
                self.roster.drop(pod.id, "lost while its generator woke")
                synced.remove(pod)
        sync_seconds = self._timed(
            "sync",
            timings,
            lambda: self.weights.sync_pods(
                synced,
                version,
                self.loop_config.max_step_attempts,
                is_lost=self._lost,
                align=frozenset(self._joining),
            ),
        )
        for pod in synced:
            if pod.id in sync_seconds:
                self._synced[pod.id] = (pod, version)
            else:
                self.roster.drop(pod.id, "lost during the weight sync")
        self._joining -= set(outcome.replies)
        return sync_seconds

    # -- asynchronous mode (rollout_buffer.py) ----------------------------------------------------
    def _produce(self, step: int, failed: ScoredBatch | None) -> ScoredBatch:
        """The producer thread's work for one step: draw its prompts (or take those of the
        failed attempt), generate them on the generating pods (holding the generator gate), and
        score them. A failed phase comes back as the batch's ``error``."""
        config = self.loop_config
        if failed is None:
            before = self.source.position()
            items = self.source.next_prompts(config.prompts_per_step)
            after = self.source.position()
        else:
            items, before, after = failed.data.items, failed.position_before, failed.position_after
        batch = ScoredBatch(step, StepSamples(items=list(items)), before, after)
        data, seconds = batch.data, batch.seconds
        try:
            with self.gate.producer(self._stopping) as held:
                if not held:
                    raise StepFailedError("generate", "the run is stopping")
                start = time.perf_counter()
                self.phases.generate(
                    step, data, config.sampling, self._seed(step), None, self._generating
                )
                seconds["generate"] = round(time.perf_counter() - start, 4)
            start = time.perf_counter()
            self.phases.score(data, self.roster.pods())
            seconds["score"] = round(time.perf_counter() - start, 4)
            check_score_errors(data, config.max_score_error_rate)
        except StepFailedError as err:
            batch.error = err
        for phase, value in seconds.items():
            metrics.PHASE_SECONDS.labels(phase).observe(value)
        return batch

    def _stopping(self) -> bool:
        return self._producer_stopped.is_set() or self._run_stop.is_set()

    def _align_async(self, expected: int) -> None:
        """A step boundary in async mode, holding the generator gate (between two batches)."""
        self._generating = self._timed("align", {}, lambda: self.align(expected))

    def run_step_async(self, attempt: int) -> StepRecord | None:
        """One step of async mode: its batch comes from the producer (generated and scored
        while earlier steps trained); groups older than ``loop.max_staleness`` versions are
        dropped; Train as in sync mode; then the weight sync (each ApplyWeights holding the
        generator gate), the next step's align (holding it too), and the record."""
        config = self.loop_config
        step = self.state.step + 1
        expected = self.state.policy_version
        timings: dict[str, float] = {}
        if self._needs_align:
            with self.gate.loop():
                self._align_async(expected)
            self._needs_align = False
        if not self.producer.started:
            self.producer.start(step)
        elif self._retry_step == step:
            self.producer.retry(step)
        self._retry_step = None
        if self._taken is None or self._taken.step != step:
            try:
                scored = self._timed("wait_for_batch", timings, lambda: self.producer.take(step))
            except StepFailedError:
                self._retry_step = step
                raise
            if scored is None:
                return None  # the run stops
            self._taken = scored
        scored = self._taken
        timings.update(scored.seconds)
        try:
            split = split_stale(scored.data, expected, config.max_staleness)
        except StepFailedError as err:  # the same batch would be refused again
            raise RunFailedError(
                f"step {step}: {err}; a generator serves a version its trainers never "
                "reached: restart the run to resume from its records and checkpoints"
            ) from err
        batch = with_stale_figures(self._build_batch(split.fresh), split)
        batch_id, outcome, epoch = self._train(
            step,
            attempt,
            expected,
            batch,
            scored.data,
            scored.position_before,
            scored.position_after,
            timings,
        )
        version = outcome.reply.policy_version if outcome else expected
        trained_ids = {s.sample_id for s in batch.sequences} if outcome else set()
        self.recorder.write_samples(step, scored.data, trained_ids)
        # Each ApplyWeights holds the generator gate (WeightSync's `applying`); the publish
        # before it overlaps the producer's batch. The step is done for the producer once the
        # generators are aligned for the next one; its record is written while that batch runs.
        sync_seconds = self._sync(outcome, version, timings)
        if step < config.steps:
            with self.gate.loop():
                try:
                    self._align_async(version)
                except StepFailedError as err:  # the next step aligns again at its start
                    log.warning("align after step %d failed: %s", step, err)
                    self._needs_align = True
        self.producer.step_done(step)
        record = self.recorder.record(
            step,
            version,
            scored.position_after,
            scored.data,
            batch,
            outcome,
            batch_id,
            timings,
            epoch=epoch,
            sync_seconds=sync_seconds,
        )
        self._taken = None
        self._recorded_position = scored.position_after
        self._count_staleness(record.metrics)
        return record
        self.producer.step_done(step)
        return record

    def _count_staleness(self, figures: dict[str, Any]) -> None:
        for lag, groups in (figures.get("staleness_histogram") or {}).items():
            for _ in range(groups):
                metrics.GROUP_STALENESS.observe(int(lag))
        metrics.STALE_GROUPS_DROPPED.inc(figures.get("groups_dropped_stale") or 0)
        metrics.STALE_SAMPLES_DROPPED.inc(figures.get("samples_dropped_stale") or 0)
        self.state.count_staleness(figures)

    def run_step_with_retries(self, stop: threading.Event) -> StepRecord | None:
        # In async mode the producer thread owns the task source (and keeps each batch's
        # positions): the loop never reads or restores it mid-run.
        position_before = None if self.asynchronous else self.source.position()
        attempts = self.loop_config.max_step_attempts
        for attempt in range(1, attempts + 1):
            try:
                return self.run_step(attempt)
            except StepFailedError as err:
                # Nothing of the attempt was applied (a Train of unknown outcome never ends up
                # here: it raises RunFailedError and keeps the step in flight for a restart).
                metrics.STEP_FAILURES.labels(err.phase).inc()
                if self.asynchronous:
                    # The same prompts again: the producer regenerates a failed batch, a batch
                    # whose Train was not applied is sent again; the next attempt aligns first.
                    self._needs_align = True
                else:
                    assert position_before is not None
                    self.source.restore(position_before)  # the same prompts, nothing kept
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
                self._wait_for_workers(stop)
                if stop.is_set():
                    return None
        return None

    # -- checkpoints and resume -------------------------------------------------------------------
    def checkpoint(self) -> str:
        # In async mode the task source is ahead (the buffer's prompts): the position after the
        # last recorded step is where a restart continues.
        position = self._recorded_position if self.asynchronous else self.source.position()
        blob = ControllerState(self.state.step, self.state.policy_version, position).encode()
        try:
            reply = self.clients.trainer(self._lead().trainer).SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(controller_state=blob), timeout=self.clients.long
            )
        except grpc.RpcError as err:
            # The run can go on: the previous checkpoint and the SQLite history still hold.
            log.error("checkpoint of step %d failed: %s", self.state.step, describe_rpc_error(err))
            self.state.set_error(f"checkpoint failed: {describe_rpc_error(err)}")
            return ""
        self.store.put("checkpoint", {"path": reply.path, "step": self.state.step})
        log.info("checkpoint of step %d at %s", self.state.step, reply.path)
        return reply.path

    def resume(self) -> None:
        """Line the controller's position up with the trainers' policy version (resume.py).

        The run's position is decided from the trainer that holds the newest version (the
        first by ordinal on a tie); trainers behind it heal from a peer in their next Train.
        When that trainer must go back to a checkpoint, so must every trainer ahead of the
        version it loads, or they would be taken for the newest replica."""
        pods = self.roster.admit()
        if not pods:
            raise RunFailedError("no complete, healthy worker pod to resume the run with")
        infos = {pod.id: self.train_phase.trainer_info(pod.trainer) for pod in pods}
        answering = [pod for pod in pods if infos[pod.id] is not None]
        if not answering:
            raise RunFailedError(f"trainer {pods[0].trainer} does not answer Info")
        lead = max(answering, key=lambda pod: (infos[pod.id].policy_version, -pods.index(pod)))
        address = lead.trainer
        info = infos[lead.id]
        assert info is not None
        trainer = TrainerState(
            info.policy_version, info.last_batch_id, info.last_train if info.last_batch_id else None
        )
        pending = self.store.pending()
        recorded = (self.store.get("checkpoint") or {}).get("path")
        on_disk = newest_checkpoint(checkpoint_folder(self.config))
        path = choose_checkpoint(
            trainer.policy_version,
            self.store,
            pending,
            recorded,
            str(on_disk) if on_disk else None,
        )
        loaded: ControllerState | None = None
        if path is not None:
            reply = self.clients.trainer(address).LoadCheckpoint(
                trainer_pb2.LoadCheckpointRequest(path=path), timeout=self.clients.long
            )
            trainer = TrainerState(reply.policy_version)
            loaded = ControllerState.decode(reply.controller_state)
            log.info("trainer restored checkpoint %s (version %d)", path, reply.policy_version)
            for pod in answering:
                other = infos[pod.id]
                if (
                    pod is not lead
                    and other is not None
                    and other.policy_version > (reply.policy_version)
                ):
                    self.clients.trainer(pod.trainer).LoadCheckpoint(
                        trainer_pb2.LoadCheckpointRequest(path=path), timeout=self.clients.long
                    )
                    log.info("trainer of pod %s restored checkpoint %s too", pod.id, path)
        plan = plan_resume(self.store, pending, trainer, loaded, checkpoint_loaded=path is not None)
        if plan.recovered is not None:
            self.recorder.record_recovered(plan.recovered)
            log.warning(
                "step %d was trained before the controller stopped: recorded (%s)",
                plan.recovered.step,
                "trainer metrics from its stored reply"
                if plan.recovered.train_reply is not None
                else "its metrics are unknown",
            )
        self.store.clear_pending()
        records, rows = self.recorder.forget_steps_after(plan.forget_after)
        if records or rows:
            log.warning(
                "forgot %d steps and %d sample rows after step %d (the trainer no longer has "
                "them; they run again)",
                records,
                rows,
                plan.forget_after,
            )
        if plan.position is not None:
            self.source.restore(plan.position)
        self._recorded_position = self.source.position()
        self.state.resume(plan.last_step, plan.policy_version)
        if self.asynchronous:
            for record in self.store.steps():  # the run's totals on /v1/status
                self.state.count_staleness(record.metrics)
        if plan.last_step:
            log.info(
                "resuming after step %d at policy version %d (position from the %s)",
                plan.last_step,
                plan.policy_version,
                plan.source.replace("_", " "),
            )
        # Generators are brought to the trainers' version (rolled back when ahead) and the
        # trainers acknowledged by the first step's align.

    # -- held-out evaluation and the export (evaluation.py) ---------------------------------------
    def _eval_phases(self, step: int) -> RunPhases:
        def run(data: StepSamples, sampling: SamplingConfig) -> None:
            version = self.state.policy_version
            with self.gate.loop():  # async mode: between two of the producer's batches
                pods = self.align(version)
                self._generating = pods
                self.phases.generate(step, data, sampling, None, version, pods)
            self.phases.score(data, self.roster.pods())

        return run

    def evaluate_after(self, step: int, when: str, stop: threading.Event) -> None:
        """The evaluation that belongs after ``step`` (0 = before the first), unless it is
        recorded already (a resumed run). It never trains and never draws from self.source."""
        if stop.is_set() or self.recorder.has_eval_after(step):
            return
        if not (self.evaluator.due_after(step) or (when == "final" and self.evaluator.enabled)):
            return
        version = self.state.policy_version
        record = self._timed(
            "evaluate",
            {},
            lambda: self.evaluator.evaluate(
                step, version, when, self._eval_phases(step), stop.wait
            ),
        )
        self.recorder.record_eval(record)

    def export(self) -> None:
        """The finished policy as a Hugging Face folder, written by the lead trainer to
        <run_dir>/export (on the trainer's filesystem); a failure is recorded, not fatal."""
        path = self.config.run_dir / "export"
        try:
            reply = self.clients.trainer(self._lead().trainer).ExportHF(
                trainer_pb2.ExportHFRequest(path=str(path)), timeout=self.clients.long
            )
        except (grpc.RpcError, StepFailedError) as err:
            error = describe_rpc_error(err) if isinstance(err, grpc.RpcError) else str(err)
            log.error("export of policy version %d failed: %s", self.state.policy_version, error)
            self.store.put("export", {"path": None, "error": error, "step": self.state.step})
            return
        self.store.put(
            "export",
            {
                "path": reply.path,
                "files": list(reply.files),
                "step": self.state.step,
                "policy_version": self.state.policy_version,
                "error": None,
            },
        )
        log.info("policy version %d exported to %s", self.state.policy_version, reply.path)

    # -- the whole run -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self._run_stop = stop
        self.weights.stop = stop
        self.train_phase.stop = stop
        try:
            self._wait_for_workers(stop)
            if stop.is_set():
                return
            self.resume()
            self.evaluate_after(
                self.state.step, "initial" if not self.state.step else "periodic", stop
            )
            while self.state.step < self.loop_config.steps and not stop.is_set():
                record = self.run_step_with_retries(stop)
                if record is None:
                    break
                every = self.loop_config.checkpoint_every
                if every and record.step % every == 0:
                    self._timed("checkpoint", {}, self.checkpoint)
                self.evaluate_after(record.step, "periodic", stop)
            if self.state.step > 0 and self.store.get("checkpoint", {}).get("step") != (
                self.state.step
            ):
                self._timed("checkpoint", {}, self.checkpoint)
            finished = self.state.step >= self.loop_config.steps
            if finished:
                self.evaluate_after(self.state.step, "final", stop)
                if self.loop_config.export_at_end:
                    self._timed("export", {}, self.export)
            self.state.set_phase("finished" if finished else "stopped")
            self.recorder.write_summary()
        except (RunFailedError, StepFailedError) as err:
            self._fail(str(err))
        except grpc.RpcError as err:
            self._fail(f"unexpected RPC failure: {describe_rpc_error(err)}")
        except Exception as err:  # the status page must say the loop is dead, and why
            log.exception("GRPO loop crashed")
            self._fail(f"loop crashed: {type(err).__name__}: {err}")
        finally:
            self._producer_stopped.set()
            self.producer.close()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self.recorder.close()

    def _fail(self, error: str) -> None:
        log.error("run failed: %s", error)
        self.state.set_error(error)
        self.state.set_phase("failed")
        self.recorder.write_summary()
