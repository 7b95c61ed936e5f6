"""Per-task Prometheus metrics of the grader."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Summary

UNKNOWN_TASK_LABEL = "<unknown>"
"""Task label of items naming a task the grader does not know (bounds label cardinality)."""

ITEMS = Counter("podrl_grader_items_total", "Items scored (including failed ones).", ["task"])
REWARD = Summary(
    "podrl_grader_reward",
    "Rewards given (fallback rewards included); _sum/_count is the mean reward.",
    ["task"],
)
BATCH_MEAN_REWARD = Gauge(
    "podrl_grader_batch_mean_reward", "Mean reward of the task's items in the last batch.", ["task"]
)
ERRORS = Counter(
    "podrl_grader_errors_total",
    "Items that got the fallback reward, by cause (exception, timeout, worker_died, unknown_task).",
    ["task", "error"],
)
TIMEOUTS = Counter(
    "podrl_grader_timeouts_total", "Items whose reward functions ran past the timeout.", ["task"]
)
ITEM_SECONDS = Histogram(
    "podrl_grader_item_seconds",
    "Time to score one item (reward functions' run time; for failures, time until the failure).",
    ["task"],
    buckets=(0.0005, 0.002, 0.01, 0.05, 0.2, 1, 5, 20, 60),
)
COMPONENT = Summary(
    "podrl_grader_reward_component",
    "Each reward function's value before weighting.",
    ["task", "component"],
)
