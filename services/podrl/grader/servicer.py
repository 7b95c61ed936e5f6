"""gRPC Grader service: batched scoring with per-item errors.

Items of a task whose rewards are all cheap built-ins are scored in this process
(``scoring_pool.score_inline``); the others go to the isolated worker pool.

Request rules: every item needs a non-empty ``id`` (otherwise the whole call fails with
INVALID_ARGUMENT naming the item); an item whose ``task`` the grader does not know gets
SCORE_ERROR_UNKNOWN_TASK and the grader's fallback reward while the other items are scored.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict

import grpc

import podrl
from podrl.config import RunConfig
from podrl.grader import metrics
from podrl.grader.rewards import BUILTIN_REWARDS, ItemInput, TaskRewardPlan
from podrl.grader.scoring_pool import ItemResult, ScoringPool, score_inline, scores_inline
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
