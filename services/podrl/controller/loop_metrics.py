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

#: Gauges of the last trained step's policy-drift figures (docs/algorithms.md, "When RL
#: drifts"), by step-record figure; a step whose figure is unknown leaves the gauge as it was.
DRIFT_GAUGES = {
    name: Gauge(f"podrl_train_{name}", help_text)
    for name, help_text in {
        "mismatch_kl": "k3 KL(generator || trainer) per completion token of the last trained "
        "step: mean of w - ln w - 1, w = exp(trainer logprob - generator logprob).",
        "logprob_diff_mean": "Mean |trainer logprob - generator logprob| per completion token.",
        "logprob_diff_max": "Largest |trainer logprob - generator logprob| of a token.",
        "is_weight_mean": "Mean behaviour importance weight w before truncation.",
        "is_weight_min": "Smallest behaviour importance weight w.",
        "is_weight_max": "Largest behaviour importance weight w before truncation.",
        "is_masked_fraction": "Fraction of tokens the off-policy mask gave no policy gradient.",
        "is_truncated_fraction": "Fraction of tokens with w > trainer.off_policy.is_cap.",
        "clip_fraction": "Fraction of tokens whose PPO ratio was clipped (any bound).",
        "clip_fraction_low": "Fraction of tokens with A < 0 and ratio < 1 - clip_eps_low.",
        "clip_fraction_high": "Fraction of tokens with A > 0 and ratio > 1 + clip_eps_high.",
        "clip_fraction_dual": "Fraction of tokens with A < 0 and ratio > clip_ratio_c.",
        "ratio_min": "Smallest PPO ratio of a token.",
        "ratio_max": "Largest PPO ratio of a token.",
        "entropy": "Mean policy entropy per completion token.",
        "grad_norm": "Gradient norm before clipping.",
        "update_ratio": "Relative update size ||theta_after - theta_before|| / ||theta_after||.",
        "behaviour_age_mean": "Mean policy versions between the trainers' and the oldest one "
        "that sampled each trained sample (0 in sync mode).",
        "behaviour_age_max": "Largest policy-version age of a trained sample.",
    }.items()
}
DRIFT_WARNINGS = Counter(
    "podrl_drift_warnings_total",
    "Trained steps whose figure left the band of loop.drift_warnings, by figure and side "
    "(high: above the max, low: below the min).",
    ["figure", "side"],
)

# Held-out evaluations (records/evaluation.py).
EVAL_ACCURACY = Gauge(
    "podrl_eval_accuracy", "Held-out accuracy of the last evaluation (reward >= pass_threshold)."
)
EVAL_REWARD = Gauge("podrl_eval_reward_mean", "Mean reward of the last evaluation.")
EVAL_STEP = Gauge("podrl_eval_step", "Step after which the last evaluation ran (0 = before).")
EVAL_TASK_ACCURACY = Gauge(
    "podrl_eval_task_accuracy", "Held-out accuracy of the last evaluation, by task.", ["task"]
)
EVALS = Gauge("podrl_evaluations", "Evaluations recorded in this run.")

# Multi-turn episodes (controller/rollout/episode_figures.py updates them as they play).
EPISODES_IN_FLIGHT = Gauge("podrl_episodes_in_flight", "Episodes being played now.")
EPISODES = Counter(
    "podrl_episodes_total",
    "Episodes that ended, by outcome (ended: played to their end; failed: the environment "
    "failed them, never trained).",
    ["outcome"],
)
EPISODE_TURNS = Counter("podrl_episode_turns_total", "Turns of episodes played.")
EPISODE_TOOL_CALLS = Counter("podrl_episode_tool_calls_total", "Tool calls of episodes' turns.")
EPISODE_TOOL_ERRORS = Counter(
    "podrl_episode_tool_errors_total", "Tool calls of episodes' turns that failed."
)
EPISODE_ENVIRONMENT_SECONDS = Histogram(
    "podrl_episode_environment_seconds",
    "The environment's time per turn (its Step, and Reset on the first turn) as the controller "
    "waited for it.",
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60),
)
