"""Applying a weight manifest to vLLM's workers: the weight lock, in-flight applies, and the
engine's mirror of the workers' weight state.

Which version the generator serves belongs to the workers (``podrl.generator.worker_extension``,
``WorkerWeights``): the engine keeps no counter, only a mirror of the state the workers send
back with every reply. :class:`WeightApplier` is the one writer of that mirror, and owns what an
apply needs around the workers' call:

* the readers-writer lock (:class:`ReadWriteLock`, writer-preferring: a waiting writer blocks
  new readers, so a steady stream of Generate calls cannot starve a weight update): every
  Generate holds the read side (:meth:`WeightApplier.reading`) from submission to its last
  token, an apply the write side, so a swap waits for running Generate calls, holds new ones
  back, and every sample is produced by one policy version; after a swap the prefix cache is
  reset (its KV blocks came from the old weights);
* one change of the weights at a time (an apply, a sleep, a wake-up: :meth:`exclusive`), and
  whether the weights are asleep (:meth:`WeightApplier.require_awake`, checked by every Generate
  and apply; ``podrl.generator.sleep_mode`` sets the level, so no Generate or apply runs the
  sleep mode's code);
* in-flight applies (``ApplyWeightsRequest.in_flight``, below);
* deadlines: an apply that passes its caller's deadline keeps the write lock while the workers
  may still be writing, for at most ``weight_apply_overrun_seconds`` more; after that the mirror
  says needs_full (Generate refused) until the next apply has waited for that one (the
  unsettled apply) and re-read the workers' state.

Before an apply takes any lock, the manifest must carry the MAC of the pod's weights key
(``podrl.weights.protocol``) and at most ``MAX_SHARDS_PER_TENSOR`` shards per parameter: a forged or
oversized manifest is refused (PERMISSION_DENIED / INVALID_ARGUMENT) without holding back a
single Generate and without touching the weight state.

**In-flight applies.** Without ``in_flight`` an apply waits for every running Generate (the
write lock), so each sample is produced by one policy version. With it, the apply takes no write
lock and lands between two engine steps while requests run, as NeMo-RL's in-flight weight
updates and SkyRL's keep-mode pause do:

- how it lands depends on where vLLM's engine core runs (:func:`in_flight_apply_kind`): in this
  process (``podrl.generator.engine_runtime.InlineEngine``) the apply runs on the engine's loop
  thread right after the step in progress (:meth:`WeightApplier._land_between_steps`); with
  ``AsyncLLM`` the scheduler is paused in vLLM's "keep" mode (requests stay where they are), the
  workers apply, and it resumes (:meth:`WeightApplier._land_paused`);
- after a version changed, vLLM's prefix cache is reset with its running requests preempted,
  so their KV blocks are recomputed by the new weights: every token sampled after the apply
  comes from the new weights alone;
- each Generate reads the served version when it starts and when each prompt's request
  finished (:class:`GenerateSpan`): a sample's ``policy_version`` .. ``last_policy_version``
  covers every version that sampled a token of it;
- an apply that leaves the weights of no known version (needs_full) fails the Generate calls
  it interrupted (:class:`RunningGenerates`, :class:`InterruptedGenerateError`): their later
  tokens came from unknown weights. A refused manifest, or one that failed before vLLM's
  parameters were touched, interrupts nothing. The running Generate calls are tracked on the
  engine's event-loop thread (one thread: no locks needed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from podrl.config.generator import GeneratorConfig
from podrl.generator import vllm_compat
from podrl.generator.engine_runtime import EngineLoop, InlineEngine, deadline_after, seconds_left
from podrl.generator.errors import GeneratorUnavailableError, InvalidRequestError
from podrl.generator.worker_extension import (
    NEEDS_FULL_HINT,
    ApplyRequest,
    ErrorKind,
    WeightPhase,
    WeightsNotServableError,
    WeightState,
    WorkerReply,
    combine,
)
from podrl.v1 import weights_pb2
from podrl.weights.protocol import GeneratorKey

log = logging.getLogger(__name__)


APPLY_METHOD = "podrl_apply_manifest"
"""The workers' apply (``PodrlWorkerExtension.podrl_apply_manifest``)."""


# ---- the weight lock -------------------------------------------------------------------------


class LockTimeoutError(TimeoutError):
    """The lock was not acquired within the caller's deadline."""


class ReadWriteLock:
    """Writer-preferring: many Generate calls (readers), or one weight swap (the writer)."""

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


# ---- in-flight applies -----------------------------------------------------------------------

BETWEEN_STEPS = "between_steps"
PAUSE_KEEP = "pause_keep"
UNSUPPORTED = "unsupported"


class InterruptedGenerateError(WeightsNotServableError):
    """An in-flight apply left the weights of no known version while this Generate ran: its
    samples are not returned (→ FAILED_PRECONDITION, "needs a full manifest")."""


def in_flight_apply_kind(engine: Any) -> str:
    """How an in-flight apply lands on ``engine``: :data:`BETWEEN_STEPS` for podrl's in-process
    engine, :data:`PAUSE_KEEP` for an ``AsyncLLM`` whose engine-core client pauses and resumes
    the scheduler (``pause_scheduler_async``, ``resume_scheduler_async``) with vLLM's "keep"
    mode, :data:`UNSUPPORTED` otherwise (applies then wait for running Generates)."""
    if isinstance(engine, InlineEngine):
        return BETWEEN_STEPS
    return PAUSE_KEEP if vllm_compat.pauses_in_keep_mode(engine) else UNSUPPORTED


@dataclass
class GenerateSpan:
    """One Generate call as the engine's loop thread saw it."""

    first_version: int
    """The version served when its requests were added."""
    last_versions: list[int] = field(default_factory=list)
    """Per prompt: the version served when that prompt's request finished."""
    lost: str | None = None
    """Why an in-flight apply failed it (None: it was not)."""


class RunningGenerates:
    """The Generate calls running on the engine's loop thread, so that an in-flight apply that
    failed part-way can fail them."""

    def __init__(self) -> None:
        self._running: dict[asyncio.Task[Any], GenerateSpan] = {}

    @contextmanager
    def track(self, span: GenerateSpan) -> Iterator[GenerateSpan]:
        """Count the current task as running ``span`` for the block. A cancellation caused by
        :meth:`fail_all` leaves it as :class:`InterruptedGenerateError`."""
        task = asyncio.current_task()
        assert task is not None, "track() runs inside a task on the engine's loop"
        self._running[task] = span
        try:
            yield span
        except asyncio.CancelledError:
            if span.lost is None:
                raise  # the caller cancelled (its deadline passed, the client went away)
            raise InterruptedGenerateError(span.lost) from None
        finally:
            self._running.pop(task, None)

    def fail_all(self, why: str) -> int:
        """Fail every running Generate (its requests are aborted); how many there were."""
        for task, span in self._running.items():
            span.lost = (
                f"{why} while this Generate ran: its samples' later tokens came from weights of "
                f"no known version; {NEEDS_FULL_HINT}"
            )
            task.cancel()
        return len(self._running)


# ---- the applier -----------------------------------------------------------------------------


class WeightApplyError(RuntimeError):
    """An apply failed after it was admitted; ``kind`` says what the caller must do
    (``FAILED_KEEPS_SERVING``: retry; ``FAILED_NEEDS_FULL``: send a full manifest), ``state``
    is what the workers hold now."""

    def __init__(self, message: str, kind: ErrorKind, state: WeightState) -> None:
        super().__init__(message)
        self.kind = kind
        self.state = state


class ApplyDeadlineError(TimeoutError):
    """ApplyWeights passed its deadline (or an earlier apply that did is still running)."""


@dataclass
class ApplyResult:
    policy_version: int
    seconds: float
    plan_cached: bool
    mode: str
    in_flight: bool = False
    """Applied while Generate calls could run (between two engine steps)."""


class WeightApplier:
    """Has vLLM's workers apply manifests; the one writer of the engine's mirror of their
    weight state. Thread-safe."""

    def __init__(
        self,
        config: GeneratorConfig,
        engine: Any,
        loop: EngineLoop,
        *,
        state: WeightState,
        in_flight_apply: str,
        parameter_count: int,
        trusted_publisher_id: str,
        key: GeneratorKey,
    ) -> None:
        self._config = config
        self._engine = engine
        self._loop = loop
        self._state = state
        """Mirror of the workers' weight state, replaced only from their replies (and set to
        needs_full while an apply they may still be running is unsettled)."""
        self.in_flight_apply = in_flight_apply
        """How an in-flight apply lands on this engine (:func:`in_flight_apply_kind`)."""
        self._parameter_count = parameter_count
        self._trusted_publisher_id = trusted_publisher_id
        self._key = key
        self.sleep_level = 0
        """0 awake, else the level of vLLM's sleep; written by ``SleepMode`` holding
        :meth:`exclusive`. Here, beside the lock every Generate and apply holds, so their check
        (:meth:`require_awake`) runs no code of the sleep mode's."""
        self._lock = ReadWriteLock()
        self._one_change = threading.Lock()
        """Held by every apply, sleep and wake-up: an in-flight apply takes no write lock, and
        must still never overlap another change of the weights."""
        self.running = RunningGenerates()
        """Generate calls on the loop thread (an in-flight apply that fails part-way fails
        them)."""
        self._unsettled: tuple[concurrent.futures.Future[list[WorkerReply]], int] | None = None
        """An apply the engine stopped waiting for: its future, its version."""

    @property
    def state(self) -> WeightState:
        """The workers' weight state as last reported (see ``podrl.generator.worker_extension``)."""
        return self._state

    def reading(self, timeout: float | None) -> AbstractContextManager[None]:
        """The read side of the lock, for one Generate call (``LockTimeoutError`` after
        ``timeout``)."""
        return self._lock.read(timeout)

    def require_awake(self) -> None:
        """Raise ``GeneratorUnavailableError`` while asleep (the caller holds a side of the
        weight lock or the change lock, so the level cannot change meanwhile)."""
        if self.sleep_level:
            raise GeneratorUnavailableError("the generator is asleep; call WakeUp first")

    @contextmanager
    def exclusive(self, deadline: float | None) -> Iterator[None]:
        """No apply, Generate, sleep or wake-up runs meanwhile (sleep mode)."""
        with self._changing_weights(deadline), self._lock.write(seconds_left(deadline)):
            yield

    # ---- applying --------------------------------------------------------------------------

    def apply(
        self,
        manifest: weights_pb2.WeightManifest,
        timeout: float | None,
        rollback: bool = False,
        in_flight: bool = False,
    ) -> ApplyResult:
        """Have every worker apply ``manifest``. Raises ``ManifestError`` (refused, nothing
        written), ``WeightApplyError`` (failed; its ``state`` says whether the previous version
        still serves or a full manifest is needed), ``ApplyDeadlineError``,
        ``LockTimeoutError``, ``GeneratorUnavailableError`` (asleep) or ``InvalidRequestError``
        (``in_flight`` with ``rollback``).

        Applying the version already served from the same storage again is a no-op success, so
        a caller that lost the reply can simply retry. ``rollback`` accepts an older version
        (the trainer restarted from a checkpoint): full manifests only, handles reopened.
        ``in_flight``: do not wait for running Generate calls, where the engine can
        (the module docstring); else the apply waits for them as without."""
        from podrl.weights.receiver import check_shard_count

        if in_flight and rollback:
            raise InvalidRequestError(
                "in_flight with rollback: a rollback is applied between generate calls (the "
                "samples running would mix a newer version into older ones); leave in_flight "
                "unset"
            )
        deadline = deadline_after(timeout)
        # Outside the locks, so Generate never waits for a manifest that is refused.
        check_shard_count(manifest, self._parameter_count)
        key = self._key.verify(manifest)
        in_flight = in_flight and self.in_flight_apply != UNSUPPORTED
        request = ApplyRequest(
            manifest=manifest.SerializeToString(),
            mode=self._config.weight_apply_mode,
            trusted_publisher_id=self._trusted_publisher_id,
            copy_streams=self._config.weight_copy_streams,
            rollback=rollback,
            segment_owner_uid=key.owner_uid,
        )
        with self._changing_weights(deadline):
            if in_flight:
                return self._apply_in_flight(request, manifest.version, deadline)
            with self._lock.write(seconds_left(deadline)):
                return self._apply_between_generates(request, manifest.version, deadline)

    @contextmanager
    def _changing_weights(self, deadline: float | None) -> Iterator[None]:
        """One apply, sleep or wake-up at a time."""
        left = seconds_left(deadline)
        if not self._one_change.acquire(timeout=-1 if left is None else left):
            raise LockTimeoutError("timed out waiting for another weight apply to finish")
        try:
            yield
        finally:
            self._one_change.release()

    def _apply_between_generates(
        self, request: ApplyRequest, version: int, deadline: float | None
    ) -> ApplyResult:
        """The apply, holding the write lock (no Generate runs)."""
        self.require_awake()
        self.settle(deadline)
        before = self._state
        self._state = before.begin(version)
        future = self._loop.submit(self._send(request))
        # Sent right behind the apply, not after its reply: one round trip to vLLM's engine
        # core fewer (1-2 ms on an H200, bench/apply_anatomy.py). The engine core runs
        # utility calls one after the other, and the write lock keeps every Generate out
        # until both are done, so no KV block of the old weights survives; a refused
        # manifest costs a cache reset, nothing else.
        reset = self._loop.submit(self._engine.reset_prefix_cache())
        try:
            replies = self._await_apply(future, version, deadline)
        except ApplyDeadlineError:
            raise
        except Exception as exc:
            self._state = before.needs_full(
                f"applying version {version}: the workers did not answer ({exc})"
            )
            raise
        self._state = combine([r.state for r in replies])
        reset.result(60)
        return self._commit(replies, version)

    def _apply_in_flight(
        self, request: ApplyRequest, version: int, deadline: float | None
    ) -> ApplyResult:
        """The apply while Generate calls may run: the mirror changes on the loop thread, in
        :meth:`_land_between_steps` or :meth:`_land_paused`, between two engine steps."""
        self.require_awake()
        self.settle(deadline)
        if self.in_flight_apply == BETWEEN_STEPS:
            future = self._engine.call_between_steps(
                functools.partial(self._land_between_steps, request, version)
            )
        else:
            future = self._loop.submit(self._land_paused(request, version))
        replies = self._await_apply(future, version, deadline)
        result = self._commit(replies, version)
        result.in_flight = True
        return result

    def _land_between_steps(self, request: ApplyRequest, version: int) -> list[WorkerReply]:
        """In-process engine core, on the loop thread between two engine steps: apply, then
        what :meth:`_landed` says (no step runs meanwhile)."""
        before = self._state
        try:
            wire = self._engine.collective_rpc_now(APPLY_METHOD, (request.to_wire(),))
            replies = [WorkerReply.from_wire(r) for r in wire]
        except Exception as exc:
            self._not_landed(before, version, exc)
            raise
        if self._landed(replies, before, version):
            self._engine.reset_prefix_cache_now(reset_running_requests=True)
        return replies

    async def _land_paused(self, request: ApplyRequest, version: int) -> list[WorkerReply]:
        """Engine core in a process of its own, on the loop thread: vLLM's scheduler paused in
        keep mode (requests stay) around the apply and what :meth:`_landed` says."""
        # An output still on its way when the scheduler pauses is read with the newer version
        # (a bound, not a lie).
        await vllm_compat.pause_scheduler_keeping_requests(self._engine)
        try:
            before = self._state
            try:
                replies = await self._send(request)
            except Exception as exc:
                self._not_landed(before, version, exc)
                raise
            if self._landed(replies, before, version):
                await self._engine.reset_prefix_cache(reset_running_requests=True)
            return replies
        finally:
            await vllm_compat.resume_scheduler(self._engine)

    async def _send(self, request: ApplyRequest) -> list[WorkerReply]:
        """Every worker's reply to ``request`` (on the loop thread)."""
        wire = await self._engine.collective_rpc(APPLY_METHOD, args=(request.to_wire(),))
        return [WorkerReply.from_wire(r) for r in wire]

    def _landed(self, replies: list[WorkerReply], before: WeightState, version: int) -> bool:
        """Mirror the workers' state before any further engine step. True when the version
        changed: the running requests' KV blocks must then be recomputed by the new weights
        (the prefix cache reset preempts them). An apply that left needs_full fails the
        running Generate calls instead."""
        self._state = combine([r.state for r in replies])
        if self._state.phase is WeightPhase.NEEDS_FULL:
            failed = self.running.fail_all(
                f"applying version {version} in flight failed part-way ({self._state.reason})"
            )
            log.error(
                "the failed in-flight apply of version %d failed %d Generate calls", version, failed
            )
            return False
        return self._state != before

    def _not_landed(self, before: WeightState, version: int, exc: Exception) -> None:
        """The workers did not answer: their weights are unknown."""
        why = f"applying version {version} in flight: the workers did not answer ({exc})"
        self._state = before.needs_full(why)
        self.running.fail_all(why)

    def _await_apply(
        self,
        future: concurrent.futures.Future[list[WorkerReply]],
        version: int,
        deadline: float | None,
    ) -> list[WorkerReply]:
        """The workers' replies. Past the deadline the write lock stays held (the workers may
        still be writing) for the overrun; after that the apply is left unsettled and the
        mirror says needs_full, so no Generate runs on weights of no known version."""
        try:
            return future.result(seconds_left(deadline))
        except concurrent.futures.TimeoutError:
            pass
        overrun = self._config.weight_apply_overrun_seconds
        passed = time.monotonic()
        log.warning(
            "applying version %d passed its deadline; Generate waits up to %.0fs more for the "
            "workers to finish",
            version,
            overrun,
        )
        try:
            replies = future.result(overrun)
        except concurrent.futures.TimeoutError:
            self._unsettled = (future, version)
            self._state = self._state.needs_full(
                f"applying version {version} passed its deadline and "
                f"weight_apply_overrun_seconds ({overrun:g}); the workers may still be writing"
            )
            raise ApplyDeadlineError(
                f"applying version {version} passed its deadline and {overrun:g}s of overrun; "
                f"{NEEDS_FULL_HINT} (Generate is refused until one is applied)"
            ) from None
        log.warning(
            "applying version %d finished %.1fs after its deadline",
            version,
            time.monotonic() - passed,
        )
        return replies

    def settle(self, deadline: float | None) -> None:
        """Wait for an apply the engine stopped waiting for, then re-read the workers' state
        (what that apply left is theirs to say). Called holding :meth:`exclusive` or the
        change lock."""
        if self._unsettled is None:
            return
        future, version = self._unsettled
        try:
            future.result(seconds_left(deadline))
        except concurrent.futures.TimeoutError:
            raise ApplyDeadlineError(
                f"an earlier apply of version {version} is still running in the workers; "
                f"{NEEDS_FULL_HINT} after it ended, retry"
            ) from None
        except Exception:
            log.exception("the unsettled apply of version %d failed", version)
        self._unsettled = None
        states = self._loop.run(
            self._engine.collective_rpc("podrl_weight_state"), seconds_left(deadline)
        )
        self._state = combine([WeightState.from_wire(s) for s in states])
        # That apply may have changed the weights: KV blocks of the old ones must go, those of
        # requests still running (it was in flight) too.
        self._loop.run(self._engine.reset_prefix_cache(reset_running_requests=True), 60)
        log.info("the apply of version %d settled: %s", version, self._state.describe())

    def _commit(self, replies: list[WorkerReply], version: int) -> ApplyResult:
        """Raise what went wrong in the workers' ``replies`` (the mirror already holds their
        state), or return the result."""
        failed = [r for r in replies if r.error_kind is not None]
        if failed and all(r.error_kind is ErrorKind.REFUSED for r in replies):
            raise failed[0].manifest_error()
        if failed:
            # Workers that disagree leave needs_full in the mirror (``combine``) whatever
            # each of them said.
            if self._state.phase is WeightPhase.NEEDS_FULL:
                kind, outcome = ErrorKind.FAILED_NEEDS_FULL, NEEDS_FULL_HINT
            else:
                kind = ErrorKind.FAILED_KEEPS_SERVING
                outcome = f"version {self._state.version} keeps serving; retry"
            raise WeightApplyError(
                f"applying version {version} failed in the workers "
                f"({'; '.join(r.error for r in failed)}); {outcome}",
                kind,
                self._state,
            )
        return ApplyResult(
            policy_version=self._state.version,
            seconds=max(r.seconds for r in replies),
            plan_cached=all(r.plan_cached for r in replies),
            mode=replies[0].mode,
        )

    # ---- sleep mode --------------------------------------------------------------------------

    def weights_dropped(self, reason: str, timeout: float | None) -> None:
        """The served parameters are gone (a level-2 sleep): the workers close their handles
        and say needs_full; call holding :meth:`exclusive`."""
        states = self._loop.run(
            self._engine.collective_rpc("podrl_drop_weights", args=(reason,)), timeout
        )
        self._state = combine([WeightState.from_wire(s) for s in states])
