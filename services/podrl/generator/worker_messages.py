"""What the engine and vLLM's workers say to each other about an apply, typed.

``collective_rpc`` hands its arguments over as they are when vLLM's engine core runs in this
process, and through msgpack (a dataclass arrives as a map, an enum as its value) when it runs
in its own, so each message crosses as a dict of plain values, the same on both: the engine
sends one :class:`ApplyRequest` (``podrl_apply_manifest``), every worker answers one
:class:`WorkerReply`. A failed apply's :class:`ErrorKind` is set where the worker caught the
exception; the engine raises it again as a typed error and the servicer maps it to a status
code through one table (``servicer.APPLY_FAILURE_STATUS``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from podrl.generator.weight_state import WeightState
from podrl.weights.errors import ManifestError, ManifestErrorKind


class ErrorKind(enum.StrEnum):
    """Why a worker's apply did not commit."""

    REFUSED = "refused"
    """The manifest was refused (``ManifestError``): nothing was written, the state is as
    before."""
    FAILED_KEEPS_SERVING = "failed_keeps_serving"
    """Failed before vLLM's parameters were touched: the version served before keeps serving
    (retry)."""
    FAILED_NEEDS_FULL = "failed_needs_full"
    """Failed, and the weight state is needs_full (vLLM's parameters were touched, or were of no
    known version before): only a full manifest brings one back."""


@dataclass(frozen=True)
class ApplyRequest:
    """One ``podrl_apply_manifest`` call: apply ``manifest`` (a serialised
    ``podrl.v1.WeightManifest``) with ``mode`` (``generator.weight_apply_mode``)."""

    manifest: bytes
    mode: str
    trusted_publisher_id: str
    """Only manifests whose ``publisher_id`` is this are applied (the pod's trainer)."""
    copy_streams: int
    """``generator.weight_copy_streams``: the streams the worker's copy plan forks over."""
    rollback: bool = False
    """Accept an older version (full manifests only) and reopen every handle."""
    segment_owner_uid: int | None = None
    """The user whose shared-memory segments may be opened (the owner of the pod's weights
    key: the trainer's)."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest,
            "mode": self.mode,
            "trusted_publisher_id": self.trusted_publisher_id,
            "copy_streams": self.copy_streams,
            "rollback": self.rollback,
            "segment_owner_uid": self.segment_owner_uid,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ApplyRequest:
        return cls(
            manifest=bytes(wire["manifest"]),
            mode=str(wire["mode"]),
            trusted_publisher_id=str(wire["trusted_publisher_id"]),
            copy_streams=int(wire["copy_streams"]),
            rollback=bool(wire["rollback"]),
            segment_owner_uid=wire["segment_owner_uid"],
        )


@dataclass(frozen=True)
class WorkerReply:
    """One worker's answer to an :class:`ApplyRequest`: its weight state after the call, and
    either how the apply ran or why it did not commit."""

    state: WeightState
    mode: str = ""
    """The apply mode that ran (``unchanged``: the version and storage already served)."""
    plan_cached: bool = False
    seconds: float = 0.0
    error_kind: ErrorKind | None = None
    error: str = ""
    """What went wrong (a refusal: the manifest error's message, without its kind)."""
    refusal: ManifestErrorKind | None = None
    """``REFUSED``: the manifest error's kind."""
    refused_name: str | None = None
    """``REFUSED``: the parameter the refusal names, if any."""

    @classmethod
    def refused(cls, err: ManifestError, state: WeightState) -> WorkerReply:
        return cls(
            state,
            error_kind=ErrorKind.REFUSED,
            error=err.message,
            refusal=err.kind,
            refused_name=err.name,
        )

    def manifest_error(self) -> ManifestError:
        """The refusal, raised again on the engine's side of ``collective_rpc``."""
        if self.error_kind is not ErrorKind.REFUSED or self.refusal is None:
            raise ValueError(f"not a refusal: {self}")
        return ManifestError(self.refusal, self.error, name=self.refused_name)

    def to_wire(self) -> dict[str, Any]:
        return {
            "state": self.state.to_wire(),
            "mode": self.mode,
            "plan_cached": self.plan_cached,
            "seconds": self.seconds,
            "error_kind": None if self.error_kind is None else self.error_kind.value,
            "error": self.error,
            "refusal": None if self.refusal is None else self.refusal.value,
            "refused_name": self.refused_name,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WorkerReply:
        return cls(
            state=WeightState.from_wire(wire["state"]),
            mode=str(wire["mode"]),
            plan_cached=bool(wire["plan_cached"]),
            seconds=float(wire["seconds"]),
            error_kind=None if wire["error_kind"] is None else ErrorKind(wire["error_kind"]),
            error=str(wire["error"]),
            refusal=None if wire["refusal"] is None else ManifestErrorKind(wire["refusal"]),
            refused_name=wire["refused_name"],
        )
