"""Typed errors of the weight-transfer protocol.

A generator maps ``ManifestError.status_code`` onto its gRPC answer: a manifest that does not
describe this model (or more shards than the receiver takes) is ``INVALID_ARGUMENT``; one
without the MAC of the pod's weights key is ``PERMISSION_DENIED``; one that does but cannot be
applied now (stale version, fingerprint without a full manifest, storage gone or unsafe,
untrusted publisher, weights that are not finite) is ``FAILED_PRECONDITION``. Either way the
weights already loaded keep serving.
"""

from __future__ import annotations

import enum

import grpc


class ManifestErrorKind(enum.Enum):
    UNKNOWN_NAME = "unknown_name"  # a shard names a parameter the model does not have
    MISSING_NAME = "missing_name"  # a model parameter has no shard in a full manifest
    SHAPE = "shape"  # global/local shape, offset, stride or nbytes do not fit
    DTYPE = "dtype"  # unknown dtype, or one that cannot be cast into the model's dtype
    COVERAGE = "coverage"  # the shards of a parameter do not tile its global shape
    PLACEMENT = "placement"  # e.g. Partial placements (the trainer must reduce first)
    STALE_VERSION = "stale_version"  # version not newer than the one applied
    FINGERPRINT = "fingerprint"  # version-only manifest for storage the receiver never saw
    UNTRUSTED = "untrusted"  # publisher_id is not the pod's own trainer
    STORAGE = "storage"  # a handle cannot be opened (segment gone or unsafe, other host/GPU)
    UNAUTHENTIC = "unauthentic"  # no MAC, or not the MAC of the pod's weights key
    LIMIT = "limit"  # more shards than the receiver takes (per tensor or in all)
    NON_FINITE = "non_finite"  # the weights hold NaN or infinity


_FAILED_PRECONDITION = {
    ManifestErrorKind.STALE_VERSION,
    ManifestErrorKind.FINGERPRINT,
    ManifestErrorKind.UNTRUSTED,
    ManifestErrorKind.STORAGE,
    ManifestErrorKind.NON_FINITE,
}


class ManifestError(ValueError):
    """A manifest was rejected; nothing was applied. ``kind`` says why, ``name`` which tensor."""

    def __init__(self, kind: ManifestErrorKind, message: str, *, name: str | None = None) -> None:
        super().__init__(f"{kind.value}: {message}")
        self.kind = kind
        self.message = message
        """Without the kind prefix (to raise the same error again across a process)."""
        self.name = name

    @property
    def status_code(self) -> grpc.StatusCode:
        if self.kind is ManifestErrorKind.UNAUTHENTIC:
            return grpc.StatusCode.PERMISSION_DENIED
        if self.kind in _FAILED_PRECONDITION:
            return grpc.StatusCode.FAILED_PRECONDITION
        return grpc.StatusCode.INVALID_ARGUMENT


class PublishError(RuntimeError):
    """The trainer cannot publish now (e.g. the previous version is not acknowledged yet)."""


class AcknowledgeError(RuntimeError):
    """An acknowledgement of a version that is not the pending one (never published, or not
    the one awaiting its acknowledgement); nothing was released."""
