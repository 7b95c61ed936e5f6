"""Experiment tracking: every step's and every evaluation's scalars, to TensorBoard event files
and (when ``tracking.wandb`` is set) to Weights & Biases.

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
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from podrl.config import ConfigError, RunConfig
from podrl.controller.records.run_store import StepRecord

log = logging.getLogger(__name__)

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
