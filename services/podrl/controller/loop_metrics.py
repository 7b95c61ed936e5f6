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
SAMPLES_SCORED = Counter(
    "podrl_samples_scored_total", "Samples scored by the grader(s), failed scores included."
)
SCORE_ERRORS = Counter(
    "podrl_score_errors_total",
    "Samples whose scoring failed (never trained on), by error.",
    ["error"],
)
DROPPED_SAMPLES = Counter(
    "podrl_dropped_samples_total",
    "Samples left out of training because of score errors (the failed ones and the rest of "
    "groups left with too few valid samples).",
)
STEP_SCORE_ERRORS = Gauge(
    "podrl_step_score_errors", "Samples of the last step whose scoring failed."
)
UNKNOWN_TRAIN_METRICS = Counter(
    "podrl_steps_unknown_train_metrics_total",
    "Trained steps whose trainer metrics are unknown (the Train reply was lost).",
)
PODS = Gauge("podrl_pods", "Worker pods in the current step's roster (they train the policy).")
EPOCH = Gauge("podrl_epoch", "Changes of the set of pods that train (the roster's epoch).")
DESIRED_REPLICAS = Gauge(
    "podrl_desired_replicas",
    "Worker pods asked for (the worker StatefulSet's spec.replicas, or the local launcher's).",
)
BUFFER_STEPS = Gauge(
    "podrl_rollout_buffer_steps",
    "async mode: scored steps waiting in the rollout buffer (at most loop.max_staleness + 1).",
)
BUFFER_GROUPS = Gauge(
    "podrl_rollout_buffer_groups", "async mode: scored groups waiting in the rollout buffer."
)
BUFFER_CAPACITY_GROUPS = Gauge(
    "podrl_rollout_buffer_capacity_groups",
    "Groups the rollout buffer can hold: (loop.max_staleness + 1) x loop.prompts_per_step in "
    "async mode, 0 in sync mode.",
)
GROUP_STALENESS = Histogram(
    "podrl_trained_group_staleness",
    "Policy versions between the one that sampled a group and the one that trained on it, "
    "per group kept for training.",
    buckets=(0, 1, 2, 3, 4, 8, 16, 32, 64),
)
STALE_GROUPS_DROPPED = Counter(
    "podrl_stale_groups_dropped_total",
    "Groups dropped because they were sampled more than loop.max_staleness versions ago.",
)
STALE_SAMPLES_DROPPED = Counter(
    "podrl_stale_samples_dropped_total", "Samples of the groups dropped as stale."
)
SAMPLES_SPANNING_VERSIONS = Counter(
    "podrl_samples_spanning_versions_total",
    "Samples trained on that more than one policy version sampled (in-flight weight updates).",
)
