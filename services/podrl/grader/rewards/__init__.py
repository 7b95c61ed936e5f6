"""Reward functions: built-ins, plug-ins by import path, and per-task weighted plans."""

from podrl.grader.rewards.builtins import BUILTIN_REWARDS
from podrl.grader.rewards.plan import (
    InvalidRewardError,
    ItemInput,
    ItemOutput,
    RewardComponent,
    TaskRewardPlan,
    score_with_plan,
)
from podrl.grader.rewards.registry import build_reward_plans, check_signature, resolve_reward

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
