"""What a step leaves behind: its record in SQLite, its samples in ``samples.jsonl``, the
Prometheus metrics, the status page, and the run's ``summary.json``.

Every figure is measured or marked unknown: a figure the controller does not know (the trainer
metrics of a step whose Train reply was lost, the rewards of a step recovered after a controller
crash) is None, stored as JSON null, shown as "—" on the dashboard and left out of every average
and total; it is never written as 0.0. Such a step carries ``metrics_unknown: true``.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from podrl.config import RunConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.pods.table import pod_order
from podrl.controller.records.drift import drift_warnings
from podrl.controller.records.evaluation import EVALS_KEY, publish_evaluation, stored_evaluations
from podrl.controller.records.resume import RecoveredStep
from podrl.controller.records.run_outputs import SampleLog, write_summary
from podrl.controller.records.run_store import RunStore, StepRecord
from podrl.controller.records.tracking import Tracker
from podrl.controller.service.status import MAX_WARNINGS, RunState
from podrl.controller.step.batch import StepSamples, TrainBatch, is_valid, last_version, sample_id
from podrl.controller.step.pod_calls import TrainOutcome
from podrl.v1 import common_pb2, grader_pb2, trainer_pb2

log = logging.getLogger(__name__)

#: Run store key of the latest failed checkpoint save, {step, error} (checkpointing.py).
CHECKPOINT_ERROR_KEY = "checkpoint_error"

#: Run store key of the latest drift warnings (records/drift.py), so a restarted controller's
#: status still shows them.
DRIFT_WARNINGS_KEY = "drift_warnings"

#: TrainMetrics fields copied into a trained step's record.
TRAIN_METRICS = (
    "loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_fraction", "grad_norm",
    "logprob_diff_mean", "logprob_diff_max", "learning_rate",
    # Policy drift (docs/trainer.md, "Metrics of a step").
    "clip_fraction_low", "clip_fraction_high", "clip_fraction_dual", "ratio_min", "ratio_max",
    "is_weight_mean", "is_weight_min", "is_weight_max", "is_masked_fraction",
    "is_truncated_fraction", "mismatch_kl", "update_ratio",
)  # fmt: skip

#: Step figures that come from the samples and their scores (unknown for a recovered step).
SAMPLE_FIGURES = (
    "reward_mean", "reward_max", "reward_by_task", "score_errors", "score_errors_by_kind",
    "dropped_samples", "groups", "groups_dropped", "groups_dropped_score_errors",
    "sequences_trained", "tokens_generated",
)  # fmt: skip


def train_figures(
    reply: trainer_pb2.TrainResponse | None, kl_measured: bool = True
) -> dict[str, float | None]:
    """The trainer's metrics of a step, each None when ``reply`` is None (not known).
    ``kl_measured`` False (``trainer.kl_coef`` 0: no reference model): the reply's ``kl`` is
    a 0.0 nothing computed, recorded as None."""
    if reply is None:
        return dict.fromkeys(TRAIN_METRICS)
    figures = {name: getattr(reply.metrics, name) for name in TRAIN_METRICS}
    if not kl_measured:
        figures["kl"] = None
    return figures


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def behaviour_age(batch: TrainBatch, trained_version: int) -> dict[str, float | None]:
    """``behaviour_age_mean`` / ``_max``: versions between the trainers' version that trained
    the batch and the oldest version that sampled each trained sample (0 in sync mode; None
    when nothing was trained)."""
    ages = [trained_version - s.policy_version for s in batch.sequences]
    return {
        "behaviour_age_mean": _mean([float(a) for a in ages]),
        "behaviour_age_max": max(ages) if ages else None,
    }


class StepRecorder:
    def __init__(self, config: RunConfig, state: RunState, store: RunStore) -> None:
        self.config = config
        self.state = state
        self.store = store
        self.samples = SampleLog(config.run_dir)
        # Without a reference model the trainer computes no KL and reports 0.0 for it.
        self._kl_measured = config.trainer.kl_coef > 0
        self._started = time.monotonic()
        self.tracker = Tracker(config)  # a tracking package that is missing fails here
        evaluations = stored_evaluations(store)
        state.set_evaluations(evaluations[-1] if evaluations else None, len(evaluations))
        state.set_warnings(store.get(DRIFT_WARNINGS_KEY, []))

    def _track(self) -> Tracker:
        """The tracker, opened on first use: by then resume has set where the run goes on."""
        if not self.tracker.opened:
            run_id = self.store.get("wandb_run_id")
            if run_id is None:
                run_id = f"{self.config.name}-{uuid.uuid4().hex[:8]}"
                self.store.put("wandb_run_id", run_id)
            self.tracker.open(self.state.step, run_id)
        return self.tracker

    def write_samples(self, step: int, data: StepSamples, trained_ids: set[str]) -> None:
        """The step's samples, written once its Train is applied (or when it trains nothing),
        so a crash before the step record leaves them for the recovered step. A sample whose
        scoring failed has ``reward: null`` and its error."""

        def row(item: Any, sample: common_pb2.Sample) -> dict[str, Any]:
            score = data.score_of(item.id, sample)
            valid = is_valid(score)
            return {
                "step": step,
                "pod": data.pod_of.get(item.id),
                "prompt_id": item.id,
                "task": item.task,
                "prompt": item.prompt,
                "reference": item.reference,
                "index": sample.index,
                "completion": sample.text,
                "finish_reason": common_pb2.FinishReason.Name(sample.finish_reason),
                "policy_version": sample.policy_version,
                "last_policy_version": last_version(sample),
                "reward": score.reward if valid else None,
                "components": dict(score.components) if valid else {},
                "score_error": None if valid else grader_pb2.ScoreError.Name(score.error),
                "score_error_message": None if valid else score.error_message,
                "trained": sample_id(item.id, sample.index) in trained_ids,
            }

        self.samples.write(row(item, sample) for item, sample in data.all_samples())

    def record(
        self,
        step: int,
        version: int,
        position_after: dict[str, Any],
        data: StepSamples,
        batch: TrainBatch,
        outcome: TrainOutcome | None,
        batch_id: str,
        timings: dict[str, float],
        epoch: int = 0,
        sync_seconds: dict[str, float] | None = None,
    ) -> StepRecord:
        """A finished step: SQLite (which also clears the step in flight), status, metrics.
        ``epoch``: the pod table's epoch it was trained in; ``sync_seconds``: pod → seconds of its
        weight sync."""
        tokens = sum(len(s.token_ids) for _, s in data.all_samples())
        figures: dict[str, Any] = {
            **batch.stats,
            "tokens_generated": tokens,
            "phase_seconds": timings,
            "trained": outcome is not None,
            "epoch": epoch,
            # The pods whose trainers applied the step (none when it trained nothing).
            "pods": sorted(outcome.replies, key=pod_order) if outcome is not None else [],
            "generated_by": data.prompts_by_pod(),
            "sync_seconds_by_pod": {
                pod: round(seconds, 4) for pod, seconds in (sync_seconds or {}).items()
            },
        }
        if outcome is not None:
            figures["batch_id"] = batch_id
            figures["batch_ids"] = outcome.batch_ids
            figures["train_sends"] = outcome.sends
            figures["metrics_unknown"] = not outcome.metrics_known
            figures.update(
                train_figures(outcome.reply if outcome.metrics_known else None, self._kl_measured)
            )
            # Train took the trainers from version - 1 to version.
            figures.update(behaviour_age(batch, version - 1))
        figures["drift_warnings"] = self._warn(step, figures)
        record = StepRecord(step, version, position_after, figures, time.time())
        self.store.record_step(record)
        self._publish(record)
        errors = batch.stats["score_errors_by_kind"]
        for kind, count in errors.items():
            metrics.SCORE_ERRORS.labels(kind).inc(count)
        metrics.STEP_SCORE_ERRORS.set(batch.stats["score_errors"])
        metrics.DROPPED_SAMPLES.inc(batch.stats["dropped_samples"])
        metrics.TOKENS_GENERATED.inc(tokens)
        metrics.SAMPLES_SCORED.inc(len(data.scores))
        self._track().log_step(record)
        return record

    def record_recovered(self, recovered: RecoveredStep) -> StepRecord:
        """A step the trainer applied while the controller that ran it died: what the trainer
        still knows (its reply, when its last batch id names the step) is recorded; the sample
        figures are unknown."""
        figures: dict[str, Any] = {
            "recovered": True,
            "prompt_ids": recovered.prompt_ids,
            "epoch": None,
            "pods": None,
            "trained": True,
            "batch_id": recovered.batch_id,
            "metrics_unknown": True,
            "phase_seconds": {},
            **dict.fromkeys(SAMPLE_FIGURES),
            **train_figures(recovered.train_reply, self._kl_measured),
            "behaviour_age_mean": None,
            "behaviour_age_max": None,
        }
        figures["drift_warnings"] = self._warn(recovered.step, figures)
        record = StepRecord(
            recovered.step,
            recovered.policy_version,
            recovered.position_after,
            figures,
            time.time(),
        )
        self.store.record_step(record)
        self._track().log_step(record)
        return record

    def _warn(self, step: int, figures: dict[str, Any]) -> list[dict[str, Any]]:
        """The step's drift warnings (records/drift.py): logged, counted in /metrics and kept
        in the status; stored with the step."""
        warnings = drift_warnings(step, figures, self.config.loop.drift_warnings)
        for warning in warnings:
            log.warning("policy drift at %s", warning["message"])
            metrics.DRIFT_WARNINGS.labels(warning["figure"], warning["side"]).inc()
        if warnings:
            kept = (self.store.get(DRIFT_WARNINGS_KEY, []) + warnings)[-MAX_WARNINGS:]
            self.store.put(DRIFT_WARNINGS_KEY, kept)
            self.state.set_warnings(kept)
        return warnings

    def record_eval(self, evaluation: dict[str, Any]) -> None:
        """An evaluation (podrl.controller.records.evaluation): the run store (replacing one
        recorded after the same step), status, /metrics, the tracking writers."""
        evaluations = [e for e in stored_evaluations(self.store) if e["step"] != evaluation["step"]]
        evaluations.append(evaluation)
        evaluations.sort(key=lambda e: e["step"])
        self.store.put(EVALS_KEY, evaluations)
        self.state.set_evaluations(evaluations[-1], len(evaluations))
        publish_evaluation(evaluation, len(evaluations))
        self._track().log_eval(evaluation)

    def has_eval_after(self, step: int) -> bool:
        return any(e["step"] == step for e in stored_evaluations(self.store))

    def close(self) -> None:
        self.tracker.close()

    def _publish(self, record: StepRecord) -> None:
        figures = record.metrics
        self.state.finish_step(
            record.step, record.policy_version, figures.get("phase_seconds") or {}, figures
        )
        metrics.STEPS.set(record.step)
        metrics.POLICY_VERSION.set(record.policy_version)
        if figures.get("reward_mean") is not None:
            metrics.REWARD_MEAN.set(figures["reward_mean"])
        if figures.get("trained") and figures.get("metrics_unknown"):
            metrics.UNKNOWN_TRAIN_METRICS.inc()
        # A step whose figure is unknown leaves the gauge at its last measured value: NaN
        # would read as a measurement.
        for name, gauge in metrics.DRIFT_GAUGES.items():
            if figures.get(name) is not None:
                gauge.set(figures[name])

    def forget_steps_after(self, step: int) -> tuple[int, int]:
        """Remove step records, sample rows and evaluations after ``step``: (records, rows)
        removed."""
        evaluations = stored_evaluations(self.store)
        kept = [e for e in evaluations if e["step"] <= step]
        if len(kept) != len(evaluations):
            self.store.put(EVALS_KEY, kept)
            self.state.set_evaluations(kept[-1] if kept else None, len(kept))
        warnings = self.store.get(DRIFT_WARNINGS_KEY, [])
        kept_warnings = [w for w in warnings if w["step"] <= step]
        if len(kept_warnings) != len(warnings):
            self.store.put(DRIFT_WARNINGS_KEY, kept_warnings)
            self.state.set_warnings(kept_warnings)
        return self.store.forget_steps_after(step), self.samples.forget_steps_after(step)

    def write_summary(self) -> None:
        """``summary.json`` from every step in the database (any number of them). Unknown
        figures are left out of the averages and totals."""
        store = self.store
        first = store.measured("reward_mean", 5, last=False)
        final = store.measured("reward_mean", 10, last=True)
        initial_mean, final_mean = _mean(first), _mean(final)
        evaluations = stored_evaluations(store)
        measured = [e for e in evaluations if e.get("accuracy") is not None]
        initial_eval = measured[0] if measured else None
        final_eval = measured[-1] if len(measured) > 1 else None
        write_summary(
            self.config.run_dir,
            {
                "run_name": self.config.name,
                "steps": self.state.step,
                "steps_trained": int(store.metric_sum("trained")),
                "steps_with_unknown_metrics": int(store.metric_sum("metrics_unknown")),
                "policy_version": self.state.policy_version,
                # Averages over a few steps: one step's mean reward is noisy.
                "initial_reward_mean": initial_mean,
                "final_reward_mean": final_mean,
                "reward_gain": final_mean / initial_mean
                if final_mean is not None and initial_mean
                else None,
                "tokens_generated": int(store.metric_sum("tokens_generated")),
                "score_errors": int(store.metric_sum("score_errors")),
                "dropped_samples": int(store.metric_sum("dropped_samples")),
                "wall_seconds": round(time.monotonic() - self._started, 2),
                "phase": self.state.phase,
                "error": self.state.error,
                # Held-out evaluation (podrl.controller.records.evaluation): the first and the last
                # one with figures, and every one in order.
                "initial_eval": initial_eval,
                "final_eval": final_eval,
                "eval_accuracy_gain": final_eval["accuracy"] - initial_eval["accuracy"]
                if initial_eval and final_eval
                else None,
                "evaluations": evaluations,
                "export": store.get("export"),
                # The last good checkpoint and the latest failed save, if any (checkpointing.py).
                "checkpoint": store.get("checkpoint"),
                "last_checkpoint_error": store.get(CHECKPOINT_ERROR_KEY),
                "tensorboard_dir": str(self.tracker.tensorboard_dir)
                if self.tracker.tensorboard_dir
                else None,
            },
        )
