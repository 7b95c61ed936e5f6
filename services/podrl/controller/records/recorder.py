"""What a step leaves behind: its record in SQLite, its samples in ``samples.jsonl``, the
Prometheus metrics, the status page, and the run's ``summary.json``.

Every figure is measured or marked unknown: a figure the controller does not know (the trainer
metrics of a step whose Train reply was lost, the rewards of a step recovered after a controller
crash) is None, stored as JSON null, shown as "—" on the dashboard and left out of every average
and total; it is never written as 0.0. Such a step carries ``metrics_unknown: true``.

The files themselves are written here too.

**The run store** (:class:`RunStore`): the controller's durable run state, SQLite in the run
directory. What must survive a controller restart: every completed step (metrics, the data
position after it, the policy version it produced) and the step in flight (its data position
before and after and the batch id of its Train, recorded BEFORE Train is called, so a restart
can tell whether the trainer applied it).

A step's metrics are a JSON object; a figure that was not measured (e.g. the loss of a step whose
Train reply was lost) is JSON ``null``, which ``json_extract`` reads as SQL NULL, and the
store's aggregates skip it.

**Run outputs** (:class:`SampleLog`, :func:`write_summary`): what a run leaves in its directory
for people, samples (JSONL) and ``summary.json``.

**Tracking** (:class:`Tracker`): every step's and every evaluation's scalars, to TensorBoard
event files and (when ``tracking.wandb`` is set) to Weights & Biases.

Neither writer needs torch: the event files are written by ``tensorboardX`` (imported with torch
hidden, so a controller that shares a virtualenv with the trainer does not load it for nothing).
Tags (one scalar each, at the loop step as its x value; an unknown figure is left out, never
written as 0):

- ``reward/mean``, ``reward/max``, ``reward/<task>``, ``score/errors``, ``score/dropped_samples``;
- ``train/<name>`` for loss, pg_loss, kl, entropy, clip_fraction, grad_norm, ratio_mean,
  learning_rate, logprob_diff_mean, logprob_diff_max, and the policy-drift figures:
  clip_fraction_low/_high/_dual, ratio_min/_max, is_weight_mean/_min/_max,
  is_masked_fraction, is_truncated_fraction, mismatch_kl, update_ratio,
  behaviour_age_mean/_max;
- ``time/<phase>_seconds`` for every phase of the step, ``time/tokens_per_second`` (completion
  tokens per second of the generate phase), ``time/weight_sync_ms``;
- ``eval/accuracy``, ``eval/reward_mean``, ``eval/<task>/accuracy``, ``eval/<task>/reward_mean``,
  ``eval/score_errors``, ``eval/seconds``.

**Drift warnings** (:func:`drift_warnings`): a trained step whose mismatch KL or update size
leaves the band of ``loop.drift_warnings`` (docs/algorithms.md, "When RL drifts") gets a warning
that names the knobs to turn. Unknown figures (None) never warn: nothing was measured.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import sys
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from podrl.config import ConfigError, RunConfig
from podrl.config.loop import DriftWarningsConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.pods.table import pod_order
from podrl.controller.service.status import MAX_WARNINGS, RunState
from podrl.controller.step.batch import StepSamples, TrainBatch, is_valid, last_version, sample_id
from podrl.controller.step.pod_calls import TrainOutcome
from podrl.v1 import common_pb2, grader_pb2, trainer_pb2

log = logging.getLogger(__name__)

#: Run store key of the latest failed checkpoint save, {step, error} (checkpointing.py).
CHECKPOINT_ERROR_KEY = "checkpoint_error"

#: Run store key of the latest drift warnings (:func:`drift_warnings`), so a restarted controller's
#: status still shows them.
DRIFT_WARNINGS_KEY = "drift_warnings"

#: Run store key of the list of evaluation records (records/evaluation.py), in order.
EVALS_KEY = "evaluations"

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


def episode_figures(data: StepSamples) -> dict[str, Any]:
    """A step's multi-turn figures: its episodes, their turns, tool calls and failed tool
    calls, and the environment's time per turn (none for a step without episodes). Failed
    episodes count among the score errors (``SCORE_ERROR_ENVIRONMENT``)."""
    episodes = list(data.turns.values())
    turns = [turn for episode in episodes for turn in episode]
    if not episodes:
        return {}
    return {
        "episodes": len(episodes),
        "episode_turns_mean": len(turns) / len(episodes),
        "tool_calls": sum(turn["tool_calls"] for turn in turns),
        "tool_errors": sum(turn["tool_errors"] for turn in turns),
        "environment_seconds_mean": (
            sum(turn["environment_seconds"] for turn in turns) / len(turns) if turns else None
        ),
    }


def _turns(turns: list[dict[str, Any]] | None) -> dict[str, Any]:
    """A multi-turn episode's row gets its turns (each turn's action and the environment's
    reply); a single-turn sample's row is as it was."""
    return {} if turns is None else {"turns": turns}


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


def stored_evaluations(store: RunStore) -> list[dict[str, Any]]:
    """Every evaluation recorded in the run store, in order."""
    return list(store.get(EVALS_KEY, []))


def publish_evaluation(evaluation: dict[str, Any], count: int) -> None:
    """The evaluation's figures on /metrics (an evaluation without figures changes nothing)."""
    metrics.EVALS.set(count)
    if evaluation.get("accuracy") is None:
        return
    metrics.EVAL_ACCURACY.set(evaluation["accuracy"])
    metrics.EVAL_STEP.set(evaluation["step"])
    if evaluation.get("reward_mean") is not None:
        metrics.EVAL_REWARD.set(evaluation["reward_mean"])
    for task, figures in evaluation.get("by_task", {}).items():
        if figures.get("accuracy") is not None:
            metrics.EVAL_TASK_ACCURACY.labels(task).set(figures["accuracy"])


@dataclass(frozen=True)
class RecoveredStep:
    """The step in flight was trained but the controller died before recording it."""

    step: int
    policy_version: int
    position_after: dict[str, Any]
    prompt_ids: list[str]
    batch_id: str
    train_reply: trainer_pb2.TrainResponse | None
    """The trainer's reply to that batch when its last_batch_id names it; None = unknown."""


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
                **_turns(data.turns.get(sample_id(item.id, sample.index))),
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
            **episode_figures(data),
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
        """The step's drift warnings (:func:`drift_warnings`): logged, counted in /metrics and kept
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


# -- the run store ---------------------------------------------------------------------------------
_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,
    policy_version INTEGER NOT NULL,
    position_after TEXT NOT NULL,
    metrics TEXT NOT NULL,
    finished_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pending (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    step INTEGER NOT NULL,
    position_before TEXT NOT NULL,
    position_after TEXT NOT NULL,
    prompt_ids TEXT NOT NULL,
    batch_id TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class StepRecord:
    step: int
    policy_version: int
    position_after: dict[str, Any]
    metrics: dict[str, Any]
    finished_at: float


@dataclass(frozen=True)
class PendingStep:
    step: int
    position_before: dict[str, Any]
    position_after: dict[str, Any]
    prompt_ids: list[str]
    batch_id: str = ""
    """The TrainRequest.batch_id sent for this step ("" when recorded by an older controller)."""


class RunStore:
    """Thread-safe access to ``<run_dir>/controller.sqlite``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a commit survives the controller process dying (SIGKILL); only an OS
        # crash or power loss can undo the last commits, and a resume then finds a trainer
        # version the records do not know, and goes back to a checkpoint (resume.py).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(pending)")}
        if "batch_id" not in columns:  # a database written before batch ids existed
            self._db.execute("ALTER TABLE pending ADD COLUMN batch_id TEXT NOT NULL DEFAULT ''")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- steps ---------------------------------------------------------------------------------
    def record_step(self, record: StepRecord) -> None:
        """Store a finished step and clear the pending marker, in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?)",
                (
                    record.step,
                    record.policy_version,
                    json.dumps(record.position_after),
                    json.dumps(record.metrics),
                    record.finished_at,
                ),
            )
            self._db.execute("DELETE FROM pending")
            self._db.execute("COMMIT")

    def _select(self, where: str, args: tuple[Any, ...]) -> list[StepRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT step, policy_version, position_after, metrics, finished_at FROM steps "
                + where,
                args,
            ).fetchall()
        return [
            StepRecord(row[0], row[1], json.loads(row[2]), json.loads(row[3]), row[4])
            for row in rows
        ]

    def steps(self, since: int = 0, limit: int | None = None) -> list[StepRecord]:
        """Steps after ``since`` in order; all of them unless ``limit`` is given."""
        return self._select(
            "WHERE step > ? ORDER BY step LIMIT ?", (since, -1 if limit is None else limit)
        )

    def step(self, step: int) -> StepRecord | None:
        found = self._select("WHERE step = ?", (step,))
        return found[0] if found else None

    def last_step(self) -> StepRecord | None:
        found = self._select("ORDER BY step DESC LIMIT 1", ())
        return found[0] if found else None

    def last_step_at_version(self, policy_version: int) -> StepRecord | None:
        """The last step after which the trainer held ``policy_version`` (None if none)."""
        found = self._select(
            "WHERE policy_version = ? ORDER BY step DESC LIMIT 1", (policy_version,)
        )
        return found[0] if found else None

    def measured(self, metric: str, count: int, *, last: bool) -> list[float]:
        """The first (or last) ``count`` measured values of ``metric``, in step order; steps
        where it is unknown (null) or absent are skipped."""
        order = "DESC" if last else "ASC"
        with self._lock:
            rows = self._db.execute(
                "SELECT json_extract(metrics, ?) AS v FROM steps WHERE v IS NOT NULL "
                f"ORDER BY step {order} LIMIT ?",
                (f"$.{metric}", count),
            ).fetchall()
        values = [float(row[0]) for row in rows]
        return values[::-1] if last else values

    def metric_sum(self, metric: str) -> float:
        """Sum of ``metric`` over every step where it was measured (0 if none)."""
        with self._lock:
            row = self._db.execute(
                "SELECT TOTAL(json_extract(metrics, ?)) FROM steps", (f"$.{metric}",)
            ).fetchone()
        return float(row[0])

    def forget_steps_after(self, step: int) -> int:
        """Drop history past ``step`` (the trainer came back from an older checkpoint)."""
        with self._lock:
            return self._db.execute("DELETE FROM steps WHERE step > ?", (step,)).rowcount

    # -- the step in flight --------------------------------------------------------------------
    def set_pending(self, pending: PendingStep) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO pending "
                "(id, step, position_before, position_after, prompt_ids, batch_id) "
                "VALUES (1, ?, ?, ?, ?, ?)",
                (
                    pending.step,
                    json.dumps(pending.position_before),
                    json.dumps(pending.position_after),
                    json.dumps(pending.prompt_ids),
                    pending.batch_id,
                ),
            )

    def pending(self) -> PendingStep | None:
        with self._lock:
            row = self._db.execute(
                "SELECT step, position_before, position_after, prompt_ids, batch_id FROM pending"
            ).fetchone()
        if row is None:
            return None
        return PendingStep(
            row[0], json.loads(row[1]), json.loads(row[2]), json.loads(row[3]), row[4]
        )

    def clear_pending(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM pending")

    # -- small values --------------------------------------------------------------------------
    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, json.dumps(value)))

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default


# -- run outputs -----------------------------------------------------------------------------------
class SampleLog:
    """Appends one JSON object per sample to ``<run_dir>/<name>`` (``samples.jsonl``)."""

    def __init__(self, run_dir: Path, name: str = "samples.jsonl") -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / name
        self._lock = threading.Lock()

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        with self._lock, open(self.path, "a", encoding="utf-8") as out:
            out.write(text)

    def forget_steps_after(self, step: int) -> int:
        """Remove the rows of steps after ``step`` (steps a resume will run again), so no step
        appears twice. The log is rewritten to a temporary file and renamed over the old one, so
        a crash leaves either the old or the new log. Returns the number of rows removed."""
        with self._lock:
            if not self.path.exists():
                return 0
            tmp = self.path.with_suffix(".jsonl.tmp")
            removed = 0
            with (
                open(self.path, encoding="utf-8") as source,
                open(tmp, "w", encoding="utf-8") as kept,
            ):
                for line in source:
                    if not line.strip():
                        continue
                    try:
                        row_step = json.loads(line).get("step")
                    except json.JSONDecodeError:
                        row_step = None  # a line torn by a crash mid-write: drop it
                    if isinstance(row_step, int) and row_step <= step:
                        kept.write(line if line.endswith("\n") else line + "\n")
                    else:
                        removed += 1
            if removed:
                tmp.replace(self.path)
            else:
                tmp.unlink()
            return removed


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = run_dir / "summary.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


# -- tracking --------------------------------------------------------------------------------------
#: TrainMetrics figures of a step record that are logged as ``train/<name>``.
TRAIN_SCALARS = (
    "loss", "pg_loss", "kl", "entropy", "clip_fraction", "grad_norm", "ratio_mean",
    "learning_rate", "logprob_diff_mean", "logprob_diff_max",
    "clip_fraction_low", "clip_fraction_high", "clip_fraction_dual", "ratio_min", "ratio_max",
    "is_weight_mean", "is_weight_min", "is_weight_max", "is_masked_fraction",
    "is_truncated_fraction", "mismatch_kl", "update_ratio", "behaviour_age_mean",
    "behaviour_age_max",
)  # fmt: skip


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def step_scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one step record's figures (unknown figures left out)."""
    out: dict[str, float | None] = {
        "reward/mean": _number(metrics.get("reward_mean")),
        "reward/max": _number(metrics.get("reward_max")),
        "score/errors": _number(metrics.get("score_errors")),
        "score/dropped_samples": _number(metrics.get("dropped_samples")),
        "tokens/generated": _number(metrics.get("tokens_generated")),
    }
    for task, reward in (metrics.get("reward_by_task") or {}).items():
        out[f"reward/{task}"] = _number(reward)
    for name in TRAIN_SCALARS:
        out[f"train/{name}"] = _number(metrics.get(name))
    phases = metrics.get("phase_seconds") or {}
    for phase, seconds in phases.items():
        out[f"time/{phase}_seconds"] = _number(seconds)
    generate, tokens = _number(phases.get("generate")), _number(metrics.get("tokens_generated"))
    if generate and tokens is not None:
        out["time/tokens_per_second"] = tokens / generate
    sync = _number(phases.get("sync"))
    if sync is not None:
        out["time/weight_sync_ms"] = 1000.0 * sync
    return {tag: value for tag, value in out.items() if value is not None}


def eval_scalars(evaluation: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of one evaluation record (podrl.controller.records.evaluation)."""
    out: dict[str, float | None] = {
        "eval/accuracy": _number(evaluation.get("accuracy")),
        "eval/reward_mean": _number(evaluation.get("reward_mean")),
        "eval/score_errors": _number(evaluation.get("score_errors")),
        "eval/seconds": _number(evaluation.get("seconds")),
    }
    for task, figures in (evaluation.get("by_task") or {}).items():
        out[f"eval/{task}/accuracy"] = _number(figures.get("accuracy"))
        out[f"eval/{task}/reward_mean"] = _number(figures.get("reward_mean"))
    return {tag: value for tag, value in out.items() if value is not None}


@contextlib.contextmanager
def _torch_hidden() -> Iterator[None]:
    """Import-time only: tensorboardX imports torch when it can (to accept tensors), which costs
    a controller seconds and hundreds of MB for nothing; torch is hidden unless already loaded."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]  # makes `import torch` fail
    try:
        yield
    finally:
        if hide and sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]


class Tracker:
    """The run's scalar writers; every method is a no-op for a writer that is not configured.

    Built at start, so that a missing package fails the controller there (ConfigError); the
    writers open on :meth:`open`, once the loop knows where the run continues."""

    def __init__(self, config: RunConfig) -> None:
        self._config = config
        self._tensorboard: Any = None
        self._wandb: Any = None
        self._wandb_module: Any = None
        self.opened = False
        tracking = config.tracking
        self.tensorboard_dir = (
            (tracking.tensorboard_dir or config.run_dir / "tensorboard")
            if tracking.tensorboard
            else None
        )
        if tracking.wandb is not None and tracking.wandb.mode != "disabled":
            try:
                import wandb
            except ImportError:
                raise ConfigError(
                    "tracking.wandb is set but the wandb package is not installed: "
                    "pip install wandb (or remove tracking.wandb from the config)"
                ) from None
            self._wandb_module = wandb

    def open(self, resume_step: int, wandb_run_id: str) -> None:
        """Open the writers. ``resume_step``: the last step already recorded (a resumed run);
        TensorBoard then drops events of later steps an earlier process wrote (they run
        again). ``wandb_run_id``: the W&B run to continue (kept in the run store, so a restarted
        controller logs to the same W&B run and a new run directory starts a new one)."""
        self.opened = True
        config = self._config
        if self.tensorboard_dir is not None:
            with _torch_hidden():
                from tensorboardX import SummaryWriter
            # Event files are named by the second they were opened and read in name order: a
            # counter keeps a restart within the same second from overwriting the earlier file,
            # and keeps the files in the order they were written.
            folder = Path(self.tensorboard_dir)
            earlier = len(list(folder.glob("events.out.tfevents.*"))) if folder.is_dir() else 0
            self._tensorboard = SummaryWriter(
                str(folder),
                purge_step=resume_step + 1 if resume_step else None,
                flush_secs=10,
                filename_suffix=f".{earlier:04d}",
            )
        if self._wandb_module is not None:
            settings = config.tracking.wandb
            assert settings is not None
            self._wandb = self._wandb_module.init(
                project=settings.project,
                entity=settings.entity,
                name=settings.run_name or config.name,
                tags=settings.tags or None,
                mode=settings.mode,
                dir=str(config.run_dir),
                config=config.model_dump(mode="json"),
                id=wandb_run_id,
                resume="allow",
            )

    def _write(self, scalars: dict[str, float], step: int, walltime: float | None) -> None:
        if self._tensorboard is not None:
            for tag, value in scalars.items():
                self._tensorboard.add_scalar(tag, value, global_step=step, walltime=walltime)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def log_step(self, record: StepRecord) -> None:
        self._write(step_scalars(record.metrics), record.step, record.finished_at)

    def log_eval(self, evaluation: Mapping[str, Any]) -> None:
        self._write(
            eval_scalars(evaluation), int(evaluation["step"]), evaluation.get("finished_at")
        )

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.finish()
            # finish() can return before wandb's service process has written the last rows;
            # teardown waits for it, so the run file (offline) or upload is complete at exit.
            self._wandb_module.teardown()
            self._wandb = None


# -- drift warnings --------------------------------------------------------------------------------
#: What to turn when a figure leaves its band, by (figure, side).
KNOBS = {
    ("mismatch_kl", "high"): (
        "the trainer and the generator disagree on the samples' log-probabilities (stale "
        "samples, a step too large, or numerics): lower trainer.lr, lower loop.max_staleness, "
        "or set trainer.off_policy.mask: token (or sequence) so far-off tokens get no gradient"
    ),
    # AdamW's step scales with the lr, hardly with the gradient's size: grad_clip is no knob.
    ("update_ratio", "high"): "one step moved the weights too far: lower trainer.lr",
    ("update_ratio", "low"): (
        "the policy does not move: raise trainer.lr (check trainer.warmup_steps), or widen "
        "trainer.off_policy.mask_low/mask_high if the mask leaves no token a gradient"
    ),
}


def drift_warnings(
    step: int, figures: dict[str, Any], band: DriftWarningsConfig
) -> list[dict[str, Any]]:
    """The warnings of one step's figures: each {step, figure, value, limit, side, knobs,
    message}, in the order mismatch_kl, update_ratio."""
    checks = (
        ("mismatch_kl", "high", band.mismatch_kl_max),
        ("update_ratio", "high", band.update_ratio_max),
        ("update_ratio", "low", band.update_ratio_min),
    )
    out = []
    for figure, side, limit in checks:
        value = figures.get(figure)
        if value is None:
            continue
        outside = value > limit if side == "high" else value < limit
        if not outside:
            continue
        knobs = KNOBS[(figure, side)]
        field = f"loop.drift_warnings.{figure}_{'max' if side == 'high' else 'min'}"
        relation = ">" if side == "high" else "<"
        out.append(
            {
                "step": step,
                "figure": figure,
                "value": value,
                "limit": limit,
                "side": side,
                "knobs": knobs,
                "message": f"step {step}: {figure} {value:.3g} {relation} {limit:g} "
                f"({field}): {knobs}",
            }
        )
    return out
