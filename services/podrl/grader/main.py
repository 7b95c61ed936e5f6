"""``podrl-grader``: the grader service process."""

from __future__ import annotations

from collections.abc import Sequence

from podrl.common.service import ServiceSpec, serve, worker_spec
from podrl.config import RunConfig
from podrl.grader.rewards import build_reward_plans
from podrl.grader.rewards.registry import preload_modules
from podrl.grader.servicer import GraderServicer, ScoringPool, scores_inline
from podrl.v1 import grader_pb2_grpc


def build_spec(config: RunConfig) -> ServiceSpec:
    # Reward functions are resolved and signature-checked here, before the server starts: a bad
    # plug-in stops the service with a ConfigError naming the field (exit code 2).
    plans = build_reward_plans(config.tasks, config.grader)
    section = config.grader
    pool = ScoringPool(
        section.workers,
        section.item_timeout_seconds,
        section.start_method,
        preload=preload_modules(plans),
    )
    if not all(scores_inline(plan) for plan in plans.values()):
        pool.warm_up()  # else no item needs a worker process: none is started
    return worker_spec(
        "grader",
        config,
        GraderServicer(config, plans, pool),
        grader_pb2_grpc.add_GraderServicer_to_server,
        on_close=[pool.close],
    )


def main(argv: Sequence[str] | None = None) -> int:
    return serve("grader", build_spec, argv)
