"""The trainer's typed errors, and their kind on the wire between its ranks.

A rank command that fails answers a ``RankReply`` with a ``RankErrorKind`` set where the rank
caught the exception (:func:`error_kind`, by class: subclasses count as their base), so rank 0's
servicer picks the gRPC status code from that kind, not from the error's text.
"""

from __future__ import annotations

from podrl.trainer.batch import BatchError
from podrl.v1 import trainer_pb2
from podrl.weights.errors import AcknowledgeError, PublishError

ErrorKind = trainer_pb2.RankErrorKind.ValueType


class TrainNotAllowedError(RuntimeError):
    """The trainer may not take a step now; the message says what must happen first
    (→ FAILED_PRECONDITION)."""


class StepAbortedError(RuntimeError):
    """A rank failed before the optimizer step, so no rank stepped: weights, optimizer state,
    schedule and policy version are unchanged on every rank (→ ABORTED: the batch may be sent
    again)."""


class NonFiniteStepError(StepAbortedError):
    """The step's loss or gradient norm is NaN or infinite: no rank stepped, nothing changed
    (→ FAILED_PRECONDITION: the same batch on the same weights would fail again)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed on some rank (every rank raises it: ``checkpoint.save`` makes
    them agree); the target is as it was before and the partial folder is removed. The message
    names the rank's error, with its errno when the OS gave one (→ INTERNAL)."""


class CheckpointNoSpaceError(CheckpointSaveError):
    """A save failed because the checkpoint's filesystem is full: ENOSPC, a quota (EDQUOT), or
    less room left than the rank's shards need (→ RESOURCE_EXHAUSTED)."""


# In order: subclasses before their bases (NonFiniteStepError, CheckpointNoSpaceError).
_KINDS: tuple[tuple[type[BaseException], ErrorKind], ...] = (
    (BatchError, trainer_pb2.RANK_ERROR_KIND_INVALID_REQUEST),
    (TrainNotAllowedError, trainer_pb2.RANK_ERROR_KIND_NOT_NOW),
    (PublishError, trainer_pb2.RANK_ERROR_KIND_NOT_NOW),
    (AcknowledgeError, trainer_pb2.RANK_ERROR_KIND_NOT_NOW),
    (CheckpointNoSpaceError, trainer_pb2.RANK_ERROR_KIND_NO_SPACE),
    (NonFiniteStepError, trainer_pb2.RANK_ERROR_KIND_NON_FINITE_STEP),
    (StepAbortedError, trainer_pb2.RANK_ERROR_KIND_STEP_ABORTED),
)


def error_kind(err: BaseException) -> ErrorKind:
    """The kind of a failure a rank caught; INTERNAL for anything the trainer did not raise on
    purpose."""
    for cls, kind in _KINDS:
        if isinstance(err, cls):
            return kind
    return trainer_pb2.RANK_ERROR_KIND_INTERNAL
