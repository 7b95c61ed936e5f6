"""The synchronous GRPO loop (ARCHITECTURE.md §2) the controller runs.

One step: draw P prompts → ``Generate`` (spread over every healthy generator) → ``Score``
(spread over graders) → group-relative advantages → ``Train`` → ``PublishWeights`` →
``ApplyWeights`` on every generator → ``AcknowledgeWeights`` → record metrics and samples;
a trainer checkpoint every k steps and at the end.

Failure semantics (never train on partial data):
- generate / score: the whole step is thrown away and retried from the same data position (the
  same prompts), up to ``loop.max_step_attempts``; then the run stops with phase ``failed``.
- train: ``Train`` is all-or-nothing on the trainer. If the call fails, the loop asks the trainer
  for its version: unchanged → retry the step; advanced → the step was applied (reply lost) and
  the loop goes on to the weight sync; trainer unreachable → the run fails.
- sync: the trainer already advanced, so only the sync is retried (never the step: that would
  train on its prompts twice); a generator that lost its cached plan gets a full manifest.

Restart: the data position after every step and the step in flight are in SQLite
(``run_store``), so a restarted controller asks the trainer for its policy version and continues
exactly after the last step the trainer applied: no prompt repeated, none skipped.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from podrl.algorithms.advantages import batch_advantages
from podrl.config import RunConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.clients import WorkerClients, fan_out
from podrl.controller.run_outputs import SampleLog, write_summary
from podrl.controller.run_store import PendingStep, RunStore, StepRecord
from podrl.controller.status import RunState
from podrl.controller.step_errors import (
    TRANSPORT_FAILURES,
    RunFailedError,
    StepFailedError,
    describe_rpc_error,
)
from podrl.controller.weight_sync import WeightSync
from podrl.tasks import PromptItem, TaskSource
from podrl.v1 import (
    common_pb2,
    controller_pb2,
    generator_pb2,
    grader_pb2,
    trainer_pb2,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _StepData:
    items: list[PromptItem]
    samples: dict[str, list[common_pb2.Sample]] = field(default_factory=dict)
    scores: dict[str, grader_pb2.ItemScore] = field(default_factory=dict)


def _split(items: Sequence[T], parts: int) -> list[list[T]]:
    """Round-robin split into ``parts`` non-empty chunks (fewer when there are few items)."""
    chunks = [list(items[i::parts]) for i in range(parts)]
    return [chunk for chunk in chunks if chunk]


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


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
        self.loop = config.loop
        self.state = state
        self.store = store
        self.clients = clients
        self.source = source
        self.samples = SampleLog(config.run_dir)
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="loop-rpc")
        self.weights = WeightSync(
            clients,
            self._pool,
            self._trainer,
            lambda: self._addresses(controller_pb2.COMPONENT_GENERATOR),
        )
        self._started = time.monotonic()

    # -- workers ---------------------------------------------------------------------------------
    def _addresses(self, component: int) -> list[str]:
        return self.state.registry.healthy_addresses(component)

    def _trainer(self) -> str:
        trainers = self._addresses(controller_pb2.COMPONENT_TRAINER)
        if not trainers:
            raise StepFailedError("train", "no healthy trainer is registered")
        return trainers[0]

    def _wait_for_workers(self, stop: threading.Event) -> None:
        deadline = time.monotonic() + self.loop.workers_timeout_seconds
        while not self.state.is_ready():
            if stop.is_set():
                return
            if time.monotonic() > deadline:
                raise RunFailedError(
                    f"fewer than {self.state.min_worker_pods} healthy worker pods after "
                    f"{self.loop.workers_timeout_seconds:.0f}s (loop.workers_timeout_seconds)"
                )
            self.state.set_phase("waiting_for_workers")
            stop.wait(0.2)

    def _on_rpc_failure(self, address: str, err: grpc.RpcError) -> None:
        if err.code() in TRANSPORT_FAILURES:
            self.state.registry.mark_unreachable(address)

    # -- phases ----------------------------------------------------------------------------------
    def _generate(self, step: int, data: _StepData) -> None:
        generators = self._addresses(controller_pb2.COMPONENT_GENERATOR)
        if not generators:
            raise StepFailedError("generate", "no healthy generator is registered")
        s = self.loop.sampling
        sampling = common_pb2.SamplingParams(
            n=s.n,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            max_tokens=s.max_tokens,
            stop=s.stop,
        )
        if self.loop.sample_seed is not None:
            sampling.seed = self.loop.sample_seed + step

        def call(address: str, chunk: list[PromptItem]) -> generator_pb2.GenerateResponse:
            request = generator_pb2.GenerateRequest(
                prompts=[
                    common_pb2.Prompt(
                        id=item.id,
                        text=item.prompt,
                        task=item.task,
                        reference=item.reference,
                        metadata=item.metadata,
                    )
                    for item in chunk
                ],
                sampling=sampling,
                request_id=f"step-{step}",
            )
            try:
                return self.clients.generator(address).Generate(request, timeout=self.clients.long)
            except grpc.RpcError as err:
                self._on_rpc_failure(address, err)
                raise StepFailedError(
                    "generate", f"generator {address}: {describe_rpc_error(err)}"
                ) from err

        chunks = _split(data.items, len(generators))
        replies = fan_out(
            self._pool,
            [lambda a=a, c=c: call(a, c) for a, c in zip(generators, chunks, strict=False)],
        )
        for reply in replies:
            for sample in reply.samples:
                data.samples.setdefault(sample.prompt_id, []).append(sample)
        version = self.state.policy_version
        for item in data.items:
            group = data.samples.get(item.id, [])
            if len(group) != s.n:
                raise StepFailedError(
                    "generate", f"prompt {item.id}: {len(group)} samples, expected {s.n}"
                )
            stale = [x.policy_version for x in group if x.policy_version != version]
            if stale:
                raise StepFailedError(
                    "generate",
                    f"prompt {item.id}: sampled by policy version {stale[0]}, expected {version}",
                )

    def _score(self, data: _StepData) -> None:
        graders = self._addresses(controller_pb2.COMPONENT_GRADER)
        if not graders:
            raise StepFailedError("score", "no healthy grader is registered")
        items = [
            grader_pb2.ScoreItem(
                id=f"{item.id}#{sample.index}",
                prompt=item.prompt,
                completion=sample.text,
                reference=item.reference,
                task=item.task,
                metadata=item.metadata,
            )
            for item in data.items
            for sample in data.samples[item.id]
        ]

        def call(address: str, chunk: list[grader_pb2.ScoreItem]) -> grader_pb2.ScoreResponse:
            try:
                return self.clients.grader(address).Score(
                    grader_pb2.ScoreRequest(items=chunk), timeout=self.clients.long
                )
            except grpc.RpcError as err:
                self._on_rpc_failure(address, err)
                raise StepFailedError(
                    "score", f"grader {address}: {describe_rpc_error(err)}"
                ) from err

        chunks = _split(items, len(graders))
        for reply in fan_out(
            self._pool, [lambda a=a, c=c: call(a, c) for a, c in zip(graders, chunks, strict=False)]
        ):
            for score in reply.scores:
                data.scores[score.id] = score
        missing = [item.id for item in items if item.id not in data.scores]
        if missing:
            raise StepFailedError("score", f"{len(missing)} samples unscored, e.g. {missing[0]}")

    def _train(self, data: _StepData) -> tuple[trainer_pb2.TrainResponse | None, dict]:
        groups = {
            item.id: [data.scores[f"{item.id}#{s.index}"].reward for s in data.samples[item.id]]
            for item in data.items
        }
        advantages = batch_advantages(groups, normalize_std=self.loop.normalize_advantages_std)
        sequences = []
        for item in data.items:
            group = advantages[item.id]
            if group.dropped:
                continue
            for sample, advantage in zip(data.samples[item.id], group.advantages, strict=True):
                sequences.append(
                    trainer_pb2.TrainSequence(
                        sample_id=f"{item.id}#{sample.index}",
                        prompt_ids=sample.prompt_token_ids,
                        completion_ids=sample.token_ids,
                        generator_logprobs=sample.logprobs,
                        advantage=advantage,
                        policy_version=sample.policy_version,
                    )
                )
        info = {
            "groups": len(groups),
            "groups_dropped": sum(g.dropped for g in advantages.values()),
            "sequences_trained": len(sequences),
        }
        if not sequences:
            return None, info  # no learning signal in any group: nothing to train on
        address = self._trainer()
        expected = self.state.policy_version
        request = trainer_pb2.TrainRequest(sequences=sequences, policy_version=expected)
        try:
            return self.clients.trainer(address).Train(request, timeout=self.clients.long), info
        except grpc.RpcError as err:
            version = self._trainer_version(address)
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT and version != expected + 1:
                raise RunFailedError(f"trainer rejected the batch: {err.details()}") from err
            if version == expected:
                raise StepFailedError("train", describe_rpc_error(err)) from err
            if version == expected + 1:
                # Applied: the reply was lost, or an earlier attempt whose call failed on our
                # side still ran to completion (then this one is refused for its version).
                return trainer_pb2.TrainResponse(policy_version=version), info
            raise RunFailedError(
                f"trainer {address} failed during Train ({describe_rpc_error(err)}) and now "
                f"reports version {version} (expected {expected}); restart the run to resume "
                "from the last checkpoint"
            ) from err

    def _trainer_version(self, address: str) -> int | None:
        try:
            info = self.clients.trainer(address).Info(
                common_pb2.InfoRequest(), timeout=self.clients.short
            )
        except grpc.RpcError:
            return None
        return info.policy_version

    # -- one step --------------------------------------------------------------------------------
    def _timed(self, phase: str, timings: dict[str, float], fn: Callable[[], T]) -> T:
        self.state.set_phase(phase)
        start = time.perf_counter()
        try:
            return fn()
        finally:
            timings[phase] = round(time.perf_counter() - start, 4)
            metrics.PHASE_SECONDS.labels(phase).observe(timings[phase])

    def run_step(self) -> StepRecord:
        step = self.state.step + 1
        position_before = self.source.position()
        timings: dict[str, float] = {}
        data = _StepData(items=self.source.next_prompts(self.loop.prompts_per_step))
        position_after = self.source.position()
        self._timed("generate", timings, lambda: self._generate(step, data))
        self._timed("score", timings, lambda: self._score(data))
        self.store.set_pending(
            PendingStep(step, position_before, position_after, [i.id for i in data.items])
        )
        reply, train_info = self._timed("train", timings, lambda: self._train(data))
        version = reply.policy_version if reply is not None else self.state.policy_version
        if reply is not None:
            self._timed(
                "sync",
                timings,
                lambda: self.weights.sync_with_retries(version, self.loop.max_step_attempts),
            )
        return self._record(step, version, position_after, data, reply, train_info, timings)

    def _record(
        self,
        step: int,
        version: int,
        position_after: dict[str, Any],
        data: _StepData,
        reply: trainer_pb2.TrainResponse | None,
        train_info: dict[str, Any],
        timings: dict[str, float],
    ) -> StepRecord:
        rewards = [score.reward for score in data.scores.values()]
        by_task: dict[str, list[float]] = {}
        for item in data.items:
            for sample in data.samples[item.id]:
                by_task.setdefault(item.task, []).append(
                    data.scores[f"{item.id}#{sample.index}"].reward
                )
        tokens = sum(len(s.token_ids) for group in data.samples.values() for s in group)
        step_metrics: dict[str, Any] = {
            "reward_mean": sum(rewards) / len(rewards),
            "reward_max": max(rewards),
            "reward_by_task": {task: sum(v) / len(v) for task, v in by_task.items()},
            "score_errors": sum(1 for s in data.scores.values() if s.error),
            "tokens_generated": tokens,
            "phase_seconds": timings,
            "trained": reply is not None,
            **train_info,
        }
        if reply is not None:
            m = reply.metrics
            for name in (
                "loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_fraction", "grad_norm",
                "logprob_diff_mean", "logprob_diff_max", "learning_rate",
            ):  # fmt: skip
                step_metrics[name] = getattr(m, name)
        record = StepRecord(step, version, position_after, step_metrics, time.time())
        self.store.record_step(record)
        self.samples.write(
            {
                "step": step,
                "prompt_id": item.id,
                "task": item.task,
                "prompt": item.prompt,
                "reference": item.reference,
                "index": sample.index,
                "completion": sample.text,
                "finish_reason": common_pb2.FinishReason.Name(sample.finish_reason),
                "policy_version": sample.policy_version,
                "reward": data.scores[f"{item.id}#{sample.index}"].reward,
                "components": dict(data.scores[f"{item.id}#{sample.index}"].components),
            }
            for item in data.items
            for sample in data.samples[item.id]
        )
        self.state.finish_step(step, version, timings, step_metrics)
        metrics.STEPS.set(step)
        metrics.POLICY_VERSION.set(version)
        metrics.REWARD_MEAN.set(step_metrics["reward_mean"])
        metrics.TOKENS_GENERATED.inc(tokens)
        metrics.SAMPLES_SCORED.inc(len(rewards))
        return record

    def _align_generators(self) -> None:
        self.weights.bring_generators_to(self.state.policy_version)

    def run_step_with_retries(self, stop: threading.Event) -> StepRecord | None:
        position_before = self.source.position()
        for attempt in range(1, self.loop.max_step_attempts + 1):
            try:
                # A generator that restarted, or missed a sync while it was unreachable, is
                # brought to the trainer's version first: its samples would be refused otherwise.
                self._timed("align", {}, self._align_generators)
                return self.run_step()
            except StepFailedError as err:
                metrics.STEP_FAILURES.labels(err.phase).inc()
                self.source.restore(position_before)  # the same prompts again, nothing kept
                self.store.clear_pending()
                log.error(
                    "step %d attempt %d/%d failed in %s",
                    self.state.step + 1,
                    attempt,
                    self.loop.max_step_attempts,
                    err,
                )
                self.state.set_error(str(err))
                if attempt == self.loop.max_step_attempts:
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
        blob = json.dumps(
            {
                "step": self.state.step,
                "policy_version": self.state.policy_version,
                "position": self.source.position(),
            }
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
        """Line the controller's position up with the trainer's policy version."""
        address = self._trainer()
        trainer = self.clients.trainer(address)
        version = self._trainer_version(address)
        if version is None:
            raise RunFailedError(f"trainer {address} does not answer Info")
        last = self.store.last_step()
        pending = self.store.pending()
        checkpoint = self.store.get("checkpoint")
        if version == 0 and last is not None and last.policy_version > 0 and checkpoint:
            reply = trainer.LoadCheckpoint(
                trainer_pb2.LoadCheckpointRequest(path=checkpoint["path"]),
                timeout=self.clients.long,
            )
            version = reply.policy_version
            log.info("trainer restored checkpoint %s (version %d)", checkpoint["path"], version)
            pending = None
        last_version = last.policy_version if last else 0
        if pending is not None and version == last_version + 1:
            # Train went through but the controller died before recording the step.
            self.store.record_step(
                StepRecord(
                    pending.step,
                    version,
                    pending.position_after,
                    {"recovered": True, "prompt_ids": pending.prompt_ids},
                    time.time(),
                )
            )
        self.store.clear_pending()
        steps = [s for s in self.store.steps() if s.policy_version <= version]
        resume_at = steps[-1] if steps else None
        if resume_at is None and version > 0:
            raise RunFailedError(
                f"the trainer holds policy version {version} but {self.config.run_dir} has no "
                "record of it; point run_dir at the run the trainer belongs to"
            )
        if resume_at is None and self.store.last_step() is not None:
            # The trainer starts from scratch (no checkpoint to go back to): so does the run.
            log.warning("the trainer is at version 0 with no checkpoint: the run starts over")
            self.store.forget_steps_after(0)
            self.store.put("initial_reward", None)
        if resume_at is not None:
            dropped = self.store.forget_steps_after(resume_at.step)
            if dropped:
                log.warning("forgot %d steps the trainer no longer has", dropped)
            self.source.restore(resume_at.position_after)
            self.state.resume(resume_at.step, version)
            log.info("resuming after step %d at policy version %d", resume_at.step, version)
        self.weights.bring_generators_to(version)

    # -- the whole run -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        self.weights.stop = stop
        try:
            self._wait_for_workers(stop)
            if stop.is_set():
                return
            self.resume()
            initial = self.store.get("initial_reward")
            while self.state.step < self.loop.steps and not stop.is_set():
                record = self.run_step_with_retries(stop)
                if record is None:
                    break
                if initial is None:
                    initial = record.metrics["reward_mean"]
                    self.store.put("initial_reward", initial)
                if self.loop.checkpoint_every and record.step % self.loop.checkpoint_every == 0:
                    self._timed("checkpoint", {}, self.checkpoint)
            if self.state.step > 0 and self.store.get("checkpoint", {}).get("step") != (
                self.state.step
            ):
                self._timed("checkpoint", {}, self.checkpoint)
            self._write_summary()
            self.state.set_phase("finished" if self.state.step >= self.loop.steps else "stopped")
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
        self._write_summary()

    def _write_summary(self) -> None:
        steps = self.store.steps()
        rewards = [s.metrics["reward_mean"] for s in steps if "reward_mean" in s.metrics]
        write_summary(
            self.config.run_dir,
            {
                "run_name": self.config.name,
                "steps": self.state.step,
                "policy_version": self.state.policy_version,
                # Averages over a few steps: one step's mean reward is noisy.
                "initial_reward_mean": _mean(rewards[:5]),
                "final_reward_mean": _mean(rewards[-10:]),
                "reward_gain": (
                    _mean(rewards[-10:]) / _mean(rewards[:5])
                    if rewards and _mean(rewards[:5])
                    else None
                ),
                "tokens_generated": sum(s.metrics.get("tokens_generated", 0) for s in steps),
                "wall_seconds": round(time.monotonic() - self._started, 2),
                "phase": self.state.phase,
                "error": self.state.error,
            },
        )
