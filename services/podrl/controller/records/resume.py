"""Where a (re)started controller continues: pure arithmetic over what the run kept.

What the run kept: the step records in the run database (``controller.sqlite``), the step in
flight (recorded before its Train), the trainer's state (policy version, last batch id and its
reply), and the controller state stored in every trainer checkpoint (``ControllerState``: step,
policy version, data position). The rule is always the same: continue right after the last step
whose result the trainer holds, at that step's data position, so no prompt is trained on twice
and none is skipped.

In async mode (``loop.mode: async``) the producer draws prompts ahead of training; every
position the run keeps (step records, the step in flight, the checkpoints' controller state) is
still the position after the prompts of the step it belongs to, never the source's current one,
so the same arithmetic holds: a restart draws the buffer's prompts again (rollout_buffer.py).

Two decisions, both pure (no RPC, no disk):

1. :func:`choose_checkpoint`: must the trainer first load a checkpoint? Yes when the run's
   records do not know the trainer's version: the trainer restarted at version 0 after the run
   had trained, or it holds a version the database has no record of (the database was lost).
   The checkpoint recorded in the database is preferred; without one, the newest complete
   checkpoint found in the trainer's checkpoint folder (when the controller can see it).
2. :func:`plan_resume`: given the trainer's state after that (and the loaded checkpoint's
   controller state), where to continue (:class:`ResumePlan`), or :class:`ResumeError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from podrl.controller.records.recorder import PendingStep, RecoveredStep, StepRecord
from podrl.controller.step.batch import names_step_batch
from podrl.controller.step_errors import RunFailedError
from podrl.v1 import trainer_pb2


class ResumeError(RunFailedError):
    """The run's records and the trainer's state do not fit together."""


class StepHistory(Protocol):
    """The run database's step records (``RunStore`` implements it)."""

    def last_step(self) -> StepRecord | None: ...

    def last_step_at_version(self, policy_version: int) -> StepRecord | None: ...


@dataclass(frozen=True)
class ControllerState:
    """The controller's part of a trainer checkpoint: after ``step`` (which left the trainer at
    ``policy_version``) the task source was at ``position``."""

    step: int
    policy_version: int
    position: dict[str, Any]

    def encode(self) -> bytes:
        return json.dumps(
            {"step": self.step, "policy_version": self.policy_version, "position": self.position}
        ).encode()

    @staticmethod
    def decode(blob: bytes) -> ControllerState | None:
        """None for an empty or foreign blob (a checkpoint not written by the loop)."""
        try:
            raw = json.loads(blob.decode()) if blob else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(raw, dict):
            return None
        step, version, position = raw.get("step"), raw.get("policy_version"), raw.get("position")
        if not (isinstance(step, int) and isinstance(version, int) and isinstance(position, dict)):
            return None
        return ControllerState(step, version, position)


@dataclass(frozen=True)
class TrainerState:
    """What the trainer's Info says (after a checkpoint load, if one was needed)."""

    policy_version: int
    last_batch_id: str = ""
    last_train: trainer_pb2.TrainResponse | None = None


@dataclass(frozen=True)
class ResumePlan:
    last_step: int
    """The last step done; the run continues with ``last_step + 1``. Step records and
    samples.jsonl rows after it are removed (they will be redone)."""
    policy_version: int
    position: dict[str, Any] | None
    """Where the task source continues; None = from its start."""
    source: str
    """Where the position comes from: "start", "database", "step_in_flight", "checkpoint"."""
    recovered: RecoveredStep | None = None
    """Record this step first."""


def _knows_version(history: StepHistory, pending: PendingStep | None, trainer_version: int) -> bool:
    """The records say where the trainer's version ends in the data. A trainer at version 0
    while the run had trained restarted: the records know version 0, but the run's progress is
    in a checkpoint."""
    last = history.last_step()
    if trainer_version == 0:
        return last is None or last.policy_version == 0
    return history.last_step_at_version(trainer_version) is not None or _in_flight_applied(
        last, pending, trainer_version
    )


def _in_flight_applied(
    last: StepRecord | None, pending: PendingStep | None, trainer_version: int
) -> bool:
    """The trainer is one version past the last record, and the step in flight follows it."""
    base_step, base_version = (last.step, last.policy_version) if last else (0, 0)
    return (
        pending is not None
        and pending.step == base_step + 1
        and trainer_version == base_version + 1
    )


def choose_checkpoint(
    trainer_version: int,
    history: StepHistory,
    pending: PendingStep | None,
    recorded: str | None,
    newest_on_disk: str | None,
) -> str | None:
    """The checkpoint the trainer must load before the run continues, or None."""
    if _knows_version(history, pending, trainer_version):
        if history.last_step() is not None or trainer_version > 0:
            return None
        # A trainer at version 0 and no records at all: a new run, or one whose database
        # was lost; a checkpoint of this run on disk says which.
        return newest_on_disk
    return recorded or newest_on_disk


def plan_resume(
    history: StepHistory,
    pending: PendingStep | None,
    trainer: TrainerState,
    loaded: ControllerState | None,
    *,
    checkpoint_loaded: bool,
) -> ResumePlan:
    """Where the run continues. ``loaded``: the controller state of the checkpoint the trainer
    just loaded (``checkpoint_loaded``; None when that checkpoint carries none)."""
    version = trainer.policy_version
    last = history.last_step()
    if not checkpoint_loaded and _in_flight_applied(last, pending, version):
        assert pending is not None
        applied = names_step_batch(trainer.last_batch_id, pending.batch_id)
        recovered = RecoveredStep(
            step=pending.step,
            policy_version=version,
            position_after=pending.position_after,
            prompt_ids=pending.prompt_ids,
            batch_id=pending.batch_id,
            train_reply=trainer.last_train if applied else None,
        )
        return ResumePlan(
            pending.step, version, pending.position_after, "step_in_flight", recovered
        )
    recorded = history.last_step_at_version(version)
    from_checkpoint = loaded if loaded is not None and loaded.policy_version == version else None
    if recorded is not None and (from_checkpoint is None or recorded.step >= from_checkpoint.step):
        return ResumePlan(recorded.step, version, recorded.position_after, "database")
    if from_checkpoint is not None:
        return ResumePlan(from_checkpoint.step, version, from_checkpoint.position, "checkpoint")
    if version == 0:
        # Nothing trained survives (or nothing was trained yet): the run starts over.
        return ResumePlan(0, 0, None, "start")
    where = (
        "the checkpoint it loaded carries no controller state"
        if checkpoint_loaded
        else ("no checkpoint was found to go back to")
    )
    raise ResumeError(
        f"the trainer holds policy version {version} but the run's records do not say where "
        f"that version is in the data ({where}); point run_dir at the run the trainer belongs "
        "to, or restart the trainer to start the run over"
    )
