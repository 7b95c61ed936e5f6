"""The ids the controller gives its Train requests, formatted and read in one place.

A step's attempt is ``<run name>:<process>:<step>:<attempt>`` (``<process>``: 8 hex digits drawn
at controller start, so a restarted controller never reuses an id a trainer may still hold as
its last applied batch). Each pod's request in round ``r`` of that attempt (a new round after a
pod was lost mid-Train, the batch re-split) is ``<attempt id>.<r>@<pod id>``. The run store keeps
the attempt id of the step in flight; a trainer reports the pod id it applied last, and a
restart asks whether that names the step in flight (:func:`names_step_batch`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class StepBatchId:
    """One attempt of one step."""

    process: str
    """``<run name>:<process>``, the same for every step of one controller process."""
    step: int
    attempt: int

    def __str__(self) -> str:
        return f"{self.process}:{self.step}:{self.attempt}"

    def for_pod(self, round_no: int, pod_id: str) -> str:
        """The batch id of ``pod_id``'s request in round ``round_no`` of this attempt."""
        return f"{self}.{round_no}@{pod_id}"


def process_prefix(run_name: str) -> str:
    """``<run name>:<process>`` for a controller process that starts now."""
    return f"{run_name}:{uuid.uuid4().hex[:8]}"


def attempt_of(batch_id: str) -> str | None:
    """The attempt id of a pod's batch id (``<attempt id>.<round>@<pod id>``); None when
    ``batch_id`` is not one."""
    head, at, pod_id = batch_id.rpartition("@")
    attempt_id, dot, round_no = head.rpartition(".")
    if not (at and pod_id and dot and attempt_id and round_no.isdigit()):
        return None
    return attempt_id


def names_step_batch(last_batch_id: str, step_batch_id: str) -> bool:
    """``last_batch_id`` (a trainer's) is one of the step's batches: the step's attempt id
    itself, or one pod's batch of any round of it."""
    if not step_batch_id or not last_batch_id:
        return False
    return last_batch_id == step_batch_id or attempt_of(last_batch_id) == step_batch_id
