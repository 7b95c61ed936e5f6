"""Tracking section of the run config: where the controller logs the run's scalars.

Every step's and every evaluation's figures (rewards, held-out accuracy, loss, KL, entropy,
clip fraction, grad norm, phase times, tokens/s, weight-sync ms) go to TensorBoard event files
under the run directory, and to Weights & Biases when ``tracking.wandb`` is set
(``podrl.controller.records.recorder``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from podrl.config.base import Section


class WandbConfig(Section):
    """A Weights & Biases run (needs the ``wandb`` package: ``pip install wandb``)."""

    project: str = Field(min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B team or user; None = your default.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online",
        description="online: stream to the W&B server; offline: write the run under "
        "<run_dir>/wandb for `wandb sync` later; disabled: log nothing.",
    )
    run_name: str | None = Field(None, description="W&B run name; None = the run's name.")
    tags: list[str] = Field(default_factory=list, description="W&B run tags.")


class TrackingConfig(Section):
    """Experiment tracking of the controller (no torch needed)."""

    tensorboard: bool = Field(
        True, description="Write TensorBoard event files (tensorboardX) to tensorboard_dir."
    )
    tensorboard_dir: Path | None = Field(
        None, description="Folder of the event files; None = <run_dir>/tensorboard."
    )
    wandb: WandbConfig | None = Field(
        None, description="Also log to Weights & Biases; None = not at all."
    )
