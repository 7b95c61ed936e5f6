"""The GRPO loop the controller runs: it sequences the parts, each in its module.

One step (docs/controller.md), over the pods the roster admits at its start (pods/roster.py):

    step boundary: admit pods, align their generators (boundary) → draw prompts →
    generate and score, each pod its share (phases) → batch over the whole step (batch) →
    Train on every pod at once, each its share (train_phase) → samples.jsonl → weight sync
    inside each pod (weight_sync) → step record (recorder)

The loop runs the steps through a step driver (parts.py's ``StepDriver``): sync_steps.py
runs one step after the other; in async mode (``loop.mode: async``) async_steps.py takes each
step's batch from a producer that generates and scores ahead while the trainers train. Both
share the Train, the sync and the record (parts.py). This module adds what is the same in both
modes: retries, a trainer checkpoint every ``loop.checkpoint_every`` steps and at the end, the
resume at start (records/checkpointing), held-out evaluations (records/evaluation).

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
"""

from __future__ import annotations

import logging
import time

import grpc

from podrl.config.loop import SamplingConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.records.checkpointing import RunCheckpoints
from podrl.controller.records.evaluation import Evaluator, RunPhases
from podrl.controller.records.run_store import StepRecord
from podrl.controller.step.batch import StepSamples
from podrl.controller.step.parts import StepDriver, StepParts
from podrl.controller.step_errors import (
    RunFailedError,
    StepFailedError,
    describe_rpc_error,
)

log = logging.getLogger(__name__)


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
            self.state.set_phase("waiting_for_workers")
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
                pods = parts.boundary.align(version)
                parts.phases.generate(step, data, sampling, None, version, pods)
            parts.phases.score(data, parts.roster.pods())

        return run

    def evaluate_after(self, step: int, when: str) -> None:
        """The evaluation that belongs after ``step`` (0 = before the first), unless it is
        recorded already (a resumed run). It never trains and never draws from the run's
        task source."""
        stop = self.parts.stop
        if stop.is_set() or self.recorder.has_eval_after(step):
            return
        if not (self.evaluator.due_after(step) or (when == "final" and self.evaluator.enabled)):
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
            self.parts.ended.set()
            self.driver.close()
            self.parts.pool.shutdown(wait=False, cancel_futures=True)
            self.recorder.close()

    def _fail(self, error: str) -> None:
        log.error("run failed: %s", error)
        self.state.set_error(error)
        self.state.set_phase("failed")
        self.recorder.write_summary()
