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


def newest_checkpoint(folder: Path) -> Path | None:
    """The complete checkpoint in ``folder`` with the highest trainer step, or None."""
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
            step = json.loads(state_file.read_text()).get("step")
        except (OSError, ValueError):
            continue
        if isinstance(step, int) and (best is None or (step, child.name) > best[:2]):
            best = (step, child.name, child)
    return best[2].absolute() if best else None
