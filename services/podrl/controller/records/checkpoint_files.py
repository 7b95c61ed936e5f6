"""The trainer's newest complete checkpoint on disk, for a resume without the run database.

Only where the controller sees the trainer's checkpoint folder (one machine, or a shared
volume); elsewhere nothing is found and a resume relies on the run database. A folder counts as
a checkpoint when it holds the trainer's state file and DCP's ``.metadata``
(``podrl.trainer.checkpoint`` writes the state file last); folders whose names start with a dot
or end in ``.tmp`` are writes in progress and are skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

from podrl.config import RunConfig

#: ``podrl.trainer.checkpoint.STATE_FILE`` (that module imports torch; the controller does not).
STATE_FILE = "trainer_state.json"


def checkpoint_folder(config: RunConfig) -> Path:
    """Where the trainer writes checkpoints when SaveCheckpoint names no path."""
    return Path(config.trainer.checkpoint_dir or config.run_dir / "checkpoints")


def _saved_version(state: object) -> object:
    """The policy version a trainer state file records: under ``train_state`` (format 2), or
    format 1's top-level ``step`` (always equal to its version)."""
    if not isinstance(state, dict):
        return None
    train_state = state.get("train_state")
    if isinstance(train_state, dict):
        return train_state.get("policy_version")
    return state.get("step")


def newest_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint in ``folder`` with the highest policy version, or None."""
    if not folder.is_dir():
        return None
    best: tuple[int, str, Path] | None = None
    for child in folder.iterdir():
        if child.name.startswith(".") or child.name.endswith(".tmp") or not child.is_dir():
            continue
        state_file = child / STATE_FILE
        if not (state_file.is_file() and (child / ".metadata").is_file()):
            continue
        try:
            version = _saved_version(json.loads(state_file.read_text()))
        except (OSError, ValueError):
            continue
        if isinstance(version, int) and (best is None or (version, child.name) > best[:2]):
            best = (version, child.name, child)
    return best[2].absolute() if best else None
