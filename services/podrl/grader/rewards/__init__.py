"""Reward functions: built-ins, plug-ins by import path, and per-task weighted plans."""

from podrl.grader.rewards.registry import build_reward_plans, check_signature, resolve_reward
from podrl.grader.rewards.scoring import (
    BUILTIN_REWARDS,
    InvalidRewardError,
    ItemInput,
    ItemOutput,
    RewardComponent,
    TaskRewardPlan,
    score_with_plan,
)

__all__ = [
    "BUILTIN_REWARDS",
    "InvalidRewardError",
    "ItemInput",
    "ItemOutput",
    "RewardComponent",
    "TaskRewardPlan",
    "build_reward_plans",
    "check_signature",
    "resolve_reward",
    "score_with_plan",
]
