"""Prometheus metrics of the GRPO loop (served on the controller's /metrics)."""

from prometheus_client import Counter, Gauge, Histogram

PHASE_SECONDS = Histogram(
    "podrl_step_phase_seconds",
    "Duration of each phase of a step.",
    ["phase"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
STEPS = Gauge("podrl_step", "Last completed step.")
POLICY_VERSION = Gauge("podrl_policy_version", "Policy version held by the trainer.")
REWARD_MEAN = Gauge("podrl_reward_mean", "Mean reward of the last step's samples.")
STEP_FAILURES = Counter("podrl_step_failures_total", "Failed step attempts, by phase.", ["phase"])
TOKENS_GENERATED = Counter("podrl_tokens_generated_total", "Completion tokens generated.")
SAMPLES_SCORED = Counter("podrl_samples_scored_total", "Samples scored by the grader(s).")
