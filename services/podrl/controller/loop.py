"""The synchronous GRPO loop the controller runs: it sequences the parts, each in its module.

One step (docs/controller.md):

    align generators → draw prompts → generate (phases) → score (phases) → batch (batch) →
    Train (train_phase) → samples.jsonl → weight sync (weight_sync) → step record (recorder)

and a trainer checkpoint every ``loop.checkpoint_every`` steps and at the end. At start, and
after a restart, ``resume`` decides where the run continues.

Failure rules:
- generate / score fail, too many score errors, or Train answered "not applied": the attempt is
  thrown away whole and the step is retried from the same data position (the same prompts), up
  to ``loop.max_step_attempts``; then the run fails.
- Train's outcome unknown (lost reply, timeout): the same request is re-sent, never a new batch
  (train_phase); a step is never applied twice.
- sync fails: the trainer already holds the new version, so only the sync is retried.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from podrl.common import faults
from podrl.config import RunConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.batch import StepSamples, build_batch, check_score_errors, train_request
from podrl.controller.checkpoint_files import checkpoint_folder, newest_checkpoint
from podrl.controller.clients import WorkerClients
from podrl.controller.phases import WorkerPhases
from podrl.controller.recorder import StepRecorder
from podrl.controller.resume import (
    ControllerState,
    TrainerState,
    choose_checkpoint,
    plan_resume,
)
from podrl.controller.run_store import PendingStep, RunStore, StepRecord
from podrl.controller.status import RunState
from podrl.controller.step_errors import RunFailedError, StepFailedError, describe_rpc_error
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
    ) -> None:
        self.config = config
        self.loop_config = config.loop
        self.state = state
        self.store = store
        self.clients = clients
        self.source = source
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="loop-rpc")
        self.phases = WorkerPhases(clients, self._pool, state.registry)
        self.train_phase = TrainPhase(clients, config.loop.max_step_attempts)
        self.weights = WeightSync(
            clients,
            self._pool,
            self._trainer,
            lambda: self.phases.addresses(controller_pb2.COMPONENT_GENERATOR),
        )
        self.recorder = StepRecorder(config, state, store)
        # Batch ids name this controller process too: one restarted never reuses an id that
        # a trainer may still hold as its last applied batch.
        self._batch_prefix = f"{config.name}:{uuid.uuid4().hex[:8]}"

    # -- workers ---------------------------------------------------------------------------------
    def _trainer(self) -> str:
        trainers = self.phases.addresses(controller_pb2.COMPONENT_TRAINER)
        if not trainers:
            raise StepFailedError("train", "no healthy trainer is registered")
        return trainers[0]

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

    # -- one step --------------------------------------------------------------------------------
    def run_step(self, attempt: int) -> StepRecord:
        config = self.loop_config
        step = self.state.step + 1
        expected = self.state.policy_version
        position_before = self.source.position()
        timings: dict[str, float] = {}
        data = StepSamples(items=self.source.next_prompts(config.prompts_per_step))
        position_after = self.source.position()
        seed = None if config.sample_seed is None else config.sample_seed + step
        self._timed(
            "generate",
            timings,
            lambda: self.phases.generate(step, data, config.sampling, seed, expected),
        )
        self._timed("score", timings, lambda: self.phases.score(data))
        check_score_errors(data, config.max_score_error_rate)
        batch = build_batch(
            data,
            normalize_std=config.normalize_advantages_std,
            min_valid_per_group=config.min_valid_samples_per_group,
        )
        batch_id = f"{self._batch_prefix}:{step}:{attempt}"
        outcome: TrainOutcome | None = None
        if batch.sequences:
            request = train_request(batch, expected, batch_id)
            address = self._trainer()
            self.store.set_pending(
                PendingStep(
                    step, position_before, position_after, [i.id for i in data.items], batch_id
                )
            )
            outcome = self._timed(
                "train", timings, lambda: self.train_phase.train(address, request)
            )
            faults.hit("controller.after_train", step=step)
        # else: no learning signal in any group, nothing to train on (recorded trained: false)
        version = outcome.reply.policy_version if outcome else expected
        trained_ids = {s.sample_id for s in batch.sequences} if outcome else set()
        self.recorder.write_samples(step, data, trained_ids)
        if outcome is not None:
            self._timed(
                "sync",
                timings,
                lambda: self.weights.sync_with_retries(version, config.max_step_attempts),
            )
        return self.recorder.record(
            step, version, position_after, data, batch, outcome, batch_id, timings
        )

    def run_step_with_retries(self, stop: threading.Event) -> StepRecord | None:
        position_before = self.source.position()
        attempts = self.loop_config.max_step_attempts
        for attempt in range(1, attempts + 1):
            try:
                # A generator that restarted, or missed a sync while it was unreachable, is
                # brought to the trainer's version first: its samples would be refused otherwise.
                self._timed(
                    "align",
                    {},
                    lambda: self.weights.bring_generators_to(self.state.policy_version),
                )
                return self.run_step(attempt)
            except StepFailedError as err:
                # Nothing of the attempt was applied (a Train of unknown outcome never ends up
                # here: it raises RunFailedError and keeps the step in flight for a restart).
                metrics.STEP_FAILURES.labels(err.phase).inc()
                self.source.restore(position_before)  # the same prompts again, nothing kept
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
        blob = ControllerState(
            self.state.step, self.state.policy_version, self.source.position()
        ).encode()
        try:
            reply = self.clients.trainer(self._trainer()).SaveCheckpoint(
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
        """Line the controller's position up with the trainer's policy version (resume.py)."""
        address = self._trainer()
        info = self.train_phase.trainer_info(address)
        if info is None:
            raise RunFailedError(f"trainer {address} does not answer Info")
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
        self.state.resume(plan.last_step, plan.policy_version)
        if plan.last_step:
            log.info(
                "resuming after step %d at policy version %d (position from the %s)",
                plan.last_step,
                plan.policy_version,
                plan.source.replace("_", " "),
            )
        self.weights.bring_generators_to(plan.policy_version)

    # -- the whole run -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.weights.stop = stop
        self.train_phase.stop = stop
        try:
            self._wait_for_workers(stop)
            if stop.is_set():
                return
            self.resume()
            while self.state.step < self.loop_config.steps and not stop.is_set():
                record = self.run_step_with_retries(stop)
                if record is None:
                    break
                every = self.loop_config.checkpoint_every
                if every and record.step % every == 0:
                    self._timed("checkpoint", {}, self.checkpoint)
            if self.state.step > 0 and self.store.get("checkpoint", {}).get("step") != (
                self.state.step
            ):
                self._timed("checkpoint", {}, self.checkpoint)
            finished = self.state.step >= self.loop_config.steps
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
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _fail(self, error: str) -> None:
        log.error("run failed: %s", error)
        self.state.set_error(error)
        self.state.set_phase("failed")
        self.recorder.write_summary()
