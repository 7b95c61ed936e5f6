"""The gRPC Grader service: batched scoring with per-item errors, each item isolated from the
rest and from the service.

Request rules: every item needs a non-empty ``id`` (otherwise the whole call fails with
INVALID_ARGUMENT naming the item); an item whose ``task`` the grader does not know gets
SCORE_ERROR_UNKNOWN_TASK and the grader's fallback reward while the other items are scored.

Reward functions run in a pool of worker processes (pebble, :class:`ScoringPool`), one item per
task, so one item that raises, hangs or kills its process fails alone: it gets an error flag and
the fallback reward, the rest of the batch is scored, and pebble replaces the dead or killed
worker. The pool itself (:class:`WorkerPool`: start, warm-up, a job with a timeout, its outcome,
stop) knows nothing of rewards; the environment service runs its episode steps in one too.

Plans made only of the cheap built-ins (:data:`INLINE_REWARDS`: string comparisons linear in
the completion, no imports, no regular expression taken from the config) cannot hang or kill a
process, so they are scored in the grader's own thread (:func:`score_inline`): a round trip to
a worker process per item cost more than the rewards themselves. Their results are the pool's
(an exception or a non-number is SCORE_ERROR_EXCEPTION with the same message).
"""

from __future__ import annotations

import enum
import importlib
import logging
import math
import multiprocessing
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from pebble import ProcessExpired, ProcessFuture, ProcessPool

import podrl
from podrl.config import RunConfig
from podrl.grader import metrics
from podrl.grader.rewards.scoring import (
    BUILTIN_REWARDS,
    ItemInput,
    TaskRewardPlan,
    score_with_plan,
)
from podrl.v1 import common_pb2, grader_pb2, grader_pb2_grpc

log = logging.getLogger(__name__)

_ERROR_LABELS = {
    grader_pb2.SCORE_ERROR_EXCEPTION: "exception",
    grader_pb2.SCORE_ERROR_TIMEOUT: "timeout",
    grader_pb2.SCORE_ERROR_WORKER_DIED: "worker_died",
    grader_pb2.SCORE_ERROR_UNKNOWN_TASK: "unknown_task",
}


class GraderServicer(grader_pb2_grpc.GraderServicer):
    def __init__(
        self, config: RunConfig, plans: dict[str, TaskRewardPlan], pool: ScoringPool
    ) -> None:
        self._config = config
        self._plans = plans
        self._pool = pool
        self._inline = {task for task, plan in plans.items() if scores_inline(plan)}

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> grader_pb2.GraderInfo:
        return grader_pb2.GraderInfo(
            info=common_pb2.ServiceInfo(
                service="podrl.v1.Grader",
                version=podrl.__version__,
                worker_id=self._config.worker_id,
            ),
            tasks=list(self._plans),
            reward_functions=sorted([*BUILTIN_REWARDS, *self._config.grader.reward_plugins]),
            task_rewards=[
                grader_pb2.TaskRewardInfo(
                    task=plan.task,
                    components=[c.label for c in plan.components],
                    weights=[c.weight for c in plan.components],
                    sources=[c.source for c in plan.components],
                    fallback_reward=plan.fallback_reward,
                )
                for plan in self._plans.values()
            ],
            item_timeout_seconds=self._pool.item_timeout,
            workers=self._pool.workers,
        )

    def Score(
        self, request: grader_pb2.ScoreRequest, context: grpc.ServicerContext
    ) -> grader_pb2.ScoreResponse:
        for index, item in enumerate(request.items):
            if not item.id:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"items[{index}].id is empty; every item needs an id (it is echoed back)",
                )
        results: list[ItemResult | None] = [None] * len(request.items)
        jobs, job_slots = [], []
        for index, item in enumerate(request.items):
            plan = self._plans.get(item.task)
            if plan is None:
                results[index] = ItemResult(
                    self._config.grader.fallback_reward,
                    error=grader_pb2.SCORE_ERROR_UNKNOWN_TASK,
                    error_message=f"unknown task {item.task!r}; this grader scores "
                    f"{sorted(self._plans)}",
                )
                continue
            if item.task in self._inline:
                results[index] = score_inline(plan, _item_input(item))
                continue
            jobs.append(
                (
                    plan,
                    _item_input(item),
                )
            )
            job_slots.append(index)
        started = time.perf_counter()
        if jobs:
            caller_gone = threading.Event()
            context.add_callback(caller_gone.set)
            for index, result in zip(job_slots, self._pool.score(jobs, caller_gone), strict=True):
                results[index] = result
        scores = []
        for item, result in zip(request.items, results, strict=True):
            assert result is not None
            scores.append(
                grader_pb2.ItemScore(
                    id=item.id,
                    reward=result.reward,
                    components=result.components,
                    error=result.error,
                    error_message=result.error_message,
                    latency_seconds=result.seconds,
                )
            )
        self._record_metrics(request, results)
        log.debug("scored %d items in %.3fs", len(scores), time.perf_counter() - started)
        return grader_pb2.ScoreResponse(scores=scores)

    def _record_metrics(
        self, request: grader_pb2.ScoreRequest, results: list[ItemResult | None]
    ) -> None:
        rewards: dict[str, list[float]] = defaultdict(list)
        for item, result in zip(request.items, results, strict=True):
            assert result is not None
            task = item.task if item.task in self._plans else metrics.UNKNOWN_TASK_LABEL
            rewards[task].append(result.reward)
            metrics.ITEMS.labels(task).inc()
            metrics.REWARD.labels(task).observe(result.reward)
            metrics.ITEM_SECONDS.labels(task).observe(result.seconds)
            for label, value in result.components.items():
                metrics.COMPONENT.labels(task, label).observe(value)
            if result.error != grader_pb2.SCORE_ERROR_NONE:
                metrics.ERRORS.labels(task, _ERROR_LABELS[result.error]).inc()
                if result.error == grader_pb2.SCORE_ERROR_TIMEOUT:
                    metrics.TIMEOUTS.labels(task).inc()
        for task, values in rewards.items():
            metrics.BATCH_MEAN_REWARD.labels(task).set(sum(values) / len(values))


def _item_input(item: grader_pb2.ScoreItem) -> ItemInput:
    return ItemInput(
        prompt=item.prompt,
        completion=item.completion,
        reference=item.reference,
        task=item.task,
        metadata=dict(item.metadata),
    )


# ---- the pool that runs the rewards ----------------------------------------------------------

ALWAYS_PRELOADED = ["podrl.grader.rewards.scoring"]


@dataclass
class ItemResult:
    reward: float
    components: dict[str, float] = field(default_factory=dict)
    error: int = grader_pb2.SCORE_ERROR_NONE
    error_message: str = ""
    seconds: float = 0.0


#: Built-ins scored in the grader's thread (module docstring). Not regex_match (a configured
#: pattern may backtrack catastrophically), math_verify or reasoning_gym (large libraries,
#: unbounded work): those, and every plug-in, run in the isolated pool.
INLINE_REWARDS = frozenset({"exact_match", "char_match", "format", "length_penalty"})
_INLINE_FUNCTIONS = frozenset(BUILTIN_REWARDS[name] for name in INLINE_REWARDS)


def scores_inline(plan: TaskRewardPlan) -> bool:
    """True when every reward of ``plan`` is one of :data:`INLINE_REWARDS`."""
    return all(component.function in _INLINE_FUNCTIONS for component in plan.components)


def score_inline(plan: TaskRewardPlan, item: ItemInput) -> ItemResult:
    """``item`` scored in this thread with a plan of :func:`scores_inline`; never raises for
    the rewards' own failure."""
    started = time.perf_counter()
    try:
        output = score_with_plan(plan, item)
    except Exception as err:
        return ItemResult(
            plan.fallback_reward,
            error=grader_pb2.SCORE_ERROR_EXCEPTION,
            error_message=_describe(err)[:1000],
            seconds=time.perf_counter() - started,
        )
    return ItemResult(output.reward, output.components, seconds=output.seconds)


class JobFailure(enum.Enum):
    """How a job of a :class:`WorkerPool` failed."""

    EXCEPTION = "exception"
    """The job's function raised (``JobOutcome.error`` holds it)."""
    TIMEOUT = "timeout"
    """It ran past its timeout; its worker was killed and replaced."""
    WORKER_DIED = "worker_died"
    """Its worker process died (``JobOutcome.error``, a ``ProcessExpired``, has the exit code)."""
    CANCELLED = "cancelled"
    """The caller went away; a running job's worker was killed."""
    OVERDUE = "overdue"
    """No result by the caller's deadline (queued behind other jobs, or stuck)."""


@dataclass
class JobOutcome:
    """A job's return value, or how it failed."""

    value: Any = None
    failure: JobFailure | None = None
    error: BaseException | None = None


class WorkerPool:
    """``workers`` processes that run jobs isolated from the service: a job that raises, hangs
    or kills its process fails alone, and pebble replaces the worker. Thread-safe. The grader
    scores in it (:class:`ScoringPool`), the environment service runs episode steps in it."""

    def __init__(
        self,
        workers: int,
        start_method: str = "forkserver",
        preload: Sequence[str] = (),
        memory_limit_mib: int | None = None,
    ) -> None:
        """``memory_limit_mib`` caps each worker's address space (RLIMIT_AS): a job that maps
        more gets MemoryError (JobFailure.EXCEPTION) instead of growing until the kernel's
        out-of-memory killer picks a process, which may be the service itself."""
        self.workers = workers
        self._memory_limit_mib = memory_limit_mib
        self._context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # The fork server imports these once; forked workers start with them loaded, so a
            # replaced worker is ready in milliseconds.
            self._context.set_forkserver_preload([*ALWAYS_PRELOADED, *preload])
        self._preload = [*ALWAYS_PRELOADED, *preload]
        self._lock = threading.Lock()
        self._pool: ProcessPool | None = None
        self._closed = False

    def _active_pool(self) -> ProcessPool:
        with self._lock:
            if self._closed:
                raise RuntimeError("the scoring pool is closed")
            if self._pool is None or not self._pool.active:
                if self._pool is not None:
                    log.warning("scoring pool stopped unexpectedly; starting a new one")
                self._pool = ProcessPool(
                    max_workers=self.workers,
                    context=self._context,
                    initializer=_limit_memory if self._memory_limit_mib else None,
                    initargs=(self._memory_limit_mib,),
                )
            return self._pool

    def warm_up(self, timeout: float = 120.0) -> None:
        """Start the workers and import the reward modules in them now, so the first batch does
        not pay for it (nor risk its items' timeouts on slow imports)."""
        pool = self._active_pool()
        futures = [
            pool.schedule(_import_modules, args=(self._preload,)) for _ in range(self.workers)
        ]
        done, _ = wait_futures(futures, timeout=timeout)
        for future in done:
            if future.exception() is not None:
                log.warning("warming up a pool worker failed: %s", future.exception())

    def submit(
        self, function: Callable[..., Any], args: tuple[Any, ...], timeout: float
    ) -> ProcessFuture:
        """Run ``function(*args)`` in a worker, killed ``timeout`` seconds after it starts
        there (pebble's timeout does not count the time queued for a free worker)."""
        return self._active_pool().schedule(function, args=args, timeout=timeout)

    def wait(
        self,
        future: ProcessFuture,
        deadline: float | None = None,
        cancelled: threading.Event | None = None,
    ) -> JobOutcome:
        """The outcome of a job from :meth:`submit`; never raises for the job's own failure.
        ``deadline`` is on ``time.monotonic``'s clock; ``cancelled`` set kills a running job."""
        while not future.done():
            if cancelled is not None and cancelled.is_set():
                future.cancel()  # pebble kills the worker of a running job
            elif deadline is not None and time.monotonic() > deadline:
                future.cancel()
                return JobOutcome(failure=JobFailure.OVERDUE)
            wait_futures([future], timeout=0.2)
        try:
            return JobOutcome(value=future.result(timeout=0))
        except FutureTimeout as err:
            if getattr(err, "traceback", None) is not None:  # raised inside the job's function
                return JobOutcome(failure=JobFailure.EXCEPTION, error=err)
            return JobOutcome(failure=JobFailure.TIMEOUT)
        except ProcessExpired as err:
            return JobOutcome(failure=JobFailure.WORKER_DIED, error=err)
        except CancelledError:
            return JobOutcome(failure=JobFailure.CANCELLED)
        except Exception as err:  # the job's function raised
            return JobOutcome(failure=JobFailure.EXCEPTION, error=err)

    def close(self) -> None:
        """Stop the workers (running jobs are abandoned)."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.stop()
            pool.join(timeout=10)


class ScoringPool(WorkerPool):
    """Scores items in a :class:`WorkerPool`; each item may run ``item_timeout`` seconds
    before its worker is killed. Concurrent batches share the workers."""

    def __init__(
        self,
        workers: int,
        item_timeout: float,
        start_method: str = "forkserver",
        preload: Sequence[str] = (),
    ) -> None:
        super().__init__(workers, start_method, preload)
        self.item_timeout = item_timeout

    def score(
        self,
        jobs: Sequence[tuple[TaskRewardPlan, ItemInput]],
        cancelled: threading.Event | None = None,
    ) -> list[ItemResult]:
        """One result per job, in order; never raises for a job's own failure."""
        started = time.perf_counter()
        futures = [
            self.submit(score_with_plan, (plan, item), self.item_timeout) for plan, item in jobs
        ]
        # pebble's timeout runs from when an item starts; queued items wait for a free worker.
        bound = self.item_timeout * (math.ceil(len(jobs) / self.workers) + 1) + 30.0
        results = []
        for (plan, _item), future in zip(jobs, futures, strict=True):
            remaining = max(bound - (time.perf_counter() - started), 0.01)
            results.append(self._result(plan, future, remaining, started, cancelled))
        return results

    def _result(
        self,
        plan: TaskRewardPlan,
        future: ProcessFuture,
        remaining: float,
        started: float,
        cancelled: threading.Event | None,
    ) -> ItemResult:
        def failed(error: int, message: str) -> ItemResult:
            return ItemResult(
                plan.fallback_reward,
                error=error,
                error_message=message[:1000],
                seconds=time.perf_counter() - started,
            )

        outcome = self.wait(future, time.monotonic() + remaining, cancelled)
        err = outcome.error
        match outcome.failure:
            case None:
                output = outcome.value
                return ItemResult(output.reward, output.components, seconds=output.seconds)
            case JobFailure.OVERDUE:
                return failed(grader_pb2.SCORE_ERROR_TIMEOUT, "no result within the batch bound")
            case JobFailure.TIMEOUT:
                return failed(
                    grader_pb2.SCORE_ERROR_TIMEOUT,
                    f"reward functions of task {plan.task!r} ran past {self.item_timeout:g}s; "
                    "the worker was killed and replaced",
                )
            case JobFailure.WORKER_DIED:
                return failed(
                    grader_pb2.SCORE_ERROR_WORKER_DIED,
                    f"the worker process died (exit code {getattr(err, 'exitcode', None)}) "
                    f"while scoring task {plan.task!r}; it was replaced",
                )
            case JobFailure.CANCELLED:
                return failed(grader_pb2.SCORE_ERROR_TIMEOUT, "cancelled: the caller went away")
        assert err is not None  # JobFailure.EXCEPTION: the reward function raised
        log.warning(
            "reward of task %s raised %s\n%s",
            plan.task,
            _describe(err),
            getattr(err, "traceback", ""),
        )
        return failed(grader_pb2.SCORE_ERROR_EXCEPTION, _describe(err))


def _limit_memory(mib: int) -> None:
    limit = mib * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _import_modules(names: Sequence[str]) -> None:
    for name in names:
        importlib.import_module(name)
    time.sleep(0.05)  # hold this worker briefly so the next warm-up task goes to another one


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"
