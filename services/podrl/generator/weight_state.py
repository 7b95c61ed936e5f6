"""What weights a generator serves: one small state machine, owned by the vLLM workers.

Every vLLM worker holds one :class:`WorkerWeights`; it is the only code that changes the
worker's :class:`WeightState`, and the only place where a manifest's version is checked against
what is served (:meth:`WeightState.admit`; which storage a version-only manifest may name is the
worker's ``WeightReceiver``'s to check: its copy plan reads that storage). The engine keeps no
counter of its own: it mirrors the state the workers send back with every reply
(:func:`combine` for several tensor-parallel workers).

::

    idle(v) --apply w--> applying(v -> w) --copied and loaded into vLLM--> idle(w)
                                  |
                                  +-- failed before vLLM's parameters were touched --> idle(v)
                                  +-- failed after, or the engine stopped waiting ----> needs_full
    needs_full --a full manifest applied--> idle(w)

* ``idle(v)``: version ``v`` serves. A manifest is admitted when its version is newer (a
  version-only one then goes on to the receiver, which applies it only from the storage its
  copy plan reads); the version and storage (``fingerprint``) served already is a no-op.
* ``applying``: a write is in progress; Generate is held back (the engine's write lock).
* ``needs_full``: the served parameters are not known to be any one version (a copy or a vLLM
  reload failed half-way, an apply overran its deadline, a level-2 sleep dropped the weights).
  Generate is refused and so is every version-only manifest; a full manifest of ``version`` or
  newer clears the state. ``version`` stays the last version completely applied.

A version is committed only after the copy *and* the load into vLLM finished, so a state never
names weights that are not fully in place.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind

NEEDS_FULL_HINT = "the generator needs a full manifest"
"""Every refusal caused by ``needs_full`` says this (the controller answers with a full one)."""


class WeightPhase(enum.StrEnum):
    IDLE = "idle"
    APPLYING = "applying"
    NEEDS_FULL = "needs_full"


class Admission(enum.Enum):
    APPLY = "apply"
    UNCHANGED = "unchanged"
    """The manifest names the version and storage already served: nothing to copy."""


class WeightsNotServableError(RuntimeError):
    """Generate was refused: the served parameters are not one known version."""


@dataclass(frozen=True)
class WeightState:
    phase: WeightPhase = WeightPhase.IDLE
    version: int = 0
    """idle: the version served (0: the weights loaded from the model folder); applying: the
    version being replaced; needs_full: the last version that was completely applied."""
    fingerprint: str | None = None
    """Storage of the last full manifest applied while idle; None when none was or when the
    served weights no longer come from it (needs_full)."""
    target: int | None = None
    """applying: the version being written."""
    reason: str = ""
    """needs_full: what left the weights unknown."""

    # ---- checks ------------------------------------------------------------------------------

    def admit(self, manifest: weights_pb2.WeightManifest, rollback: bool = False) -> Admission:
        """Whether ``manifest`` may be applied now; raises ``ManifestError`` (a refusal:
        nothing is written) with a FAILED_PRECONDITION kind otherwise.

        ``rollback`` accepts an older version (the trainer went back to a checkpoint), as a
        full manifest only, and only a version older than the last one applied. Which storage a
        version-only manifest names is not checked here: the receiver refuses one whose storage
        its copy plan does not read (``WeightReceiver.validate``)."""
        version = manifest.version
        if manifest.version_only and (rollback or self.phase is WeightPhase.NEEDS_FULL):
            why = "a rollback" if rollback else self.reason
            raise ManifestError(
                ManifestErrorKind.FINGERPRINT,
                f"version-only manifest of version {version} refused: {why}; "
                f"{NEEDS_FULL_HINT}: publish with force_full",
            )
        if rollback:
            # Back to a checkpoint means an older version: never a relabelled or rewritten
            # served one (the weights of "version v" must stay those of version v).
            if version >= self.version:
                raise ManifestError(
                    ManifestErrorKind.STALE_VERSION,
                    f"a rollback must go to an older version than {self.version} (the last "
                    f"version applied), not to {version}; send newer versions without rollback",
                )
            return Admission.APPLY
        if self.phase is WeightPhase.NEEDS_FULL:
            # The served weights are unknown, so the last good version may be written again.
            if version < self.version:
                raise ManifestError(
                    ManifestErrorKind.STALE_VERSION,
                    f"version {version} is older than the last version applied "
                    f"({self.version}); {NEEDS_FULL_HINT} of version {self.version} or newer "
                    "(or a rollback)",
                )
            return Admission.APPLY
        if (
            version == self.version
            and self.fingerprint is not None
            and manifest.model_fingerprint == self.fingerprint
        ):
            return Admission.UNCHANGED  # a caller that lost the reply retries
        if version <= self.version:
            raise ManifestError(
                ManifestErrorKind.STALE_VERSION,
                f"version {version} is not newer than the version being served "
                f"({self.version}); publish a newer version",
            )
        return Admission.APPLY

    def require_servable(self) -> None:
        """Raise ``WeightsNotServableError`` unless one known version is in place."""
        if self.phase is WeightPhase.NEEDS_FULL:
            raise WeightsNotServableError(
                f"{NEEDS_FULL_HINT} before it can generate: {self.reason}"
            )
        if self.phase is WeightPhase.APPLYING:
            raise WeightsNotServableError(f"version {self.target} is being applied")

    # ---- transitions -------------------------------------------------------------------------

    def begin(self, version: int) -> WeightState:
        """idle | needs_full -> applying(version)."""
        if self.phase is WeightPhase.APPLYING:
            raise RuntimeError(f"an apply of version {self.target} is already in progress")
        return replace(self, phase=WeightPhase.APPLYING, target=version)

    def commit(self, fingerprint: str | None) -> WeightState:
        """applying(v -> w) -> idle(w) from storage ``fingerprint``."""
        if self.phase is not WeightPhase.APPLYING or self.target is None:
            raise RuntimeError(f"commit without an apply in progress (state {self.phase})")
        return WeightState(WeightPhase.IDLE, self.target, fingerprint)

    def needs_full(self, reason: str) -> WeightState:
        """Any state -> needs_full; ``version`` stays the last version completely applied."""
        return WeightState(WeightPhase.NEEDS_FULL, self.version, None, None, reason)

    # ---- crossing collective_rpc (plain values only) -----------------------------------------

    def to_wire(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "target": self.target,
            "reason": self.reason,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WeightState:
        return cls(
            phase=WeightPhase(wire["phase"]),
            version=int(wire["version"]),
            fingerprint=wire["fingerprint"],
            target=wire["target"],
            reason=wire["reason"],
        )

    def describe(self) -> str:
        if self.phase is WeightPhase.APPLYING:
            return f"applying {self.version} -> {self.target}"
        if self.phase is WeightPhase.NEEDS_FULL:
            return f"needs_full (last applied {self.version}: {self.reason})"
        return f"idle (serving {self.version})"


def combine(states: Sequence[WeightState]) -> WeightState:
    """One state for an engine of several workers: theirs when they agree, else needs_full."""
    if not states:
        raise ValueError("no worker states")
    first = states[0]
    if all(state == first for state in states):
        return first
    return WeightState(
        WeightPhase.NEEDS_FULL,
        min(state.version for state in states),
        reason="the workers disagree: " + "; ".join(state.describe() for state in states),
    )


class WriteGuard:
    """Handed to the code inside :meth:`WorkerWeights.applying`: it calls
    :meth:`touching_served_weights` right before it writes into the parameters vLLM serves."""

    def __init__(self) -> None:
        self.served_weights_touched = False

    def touching_served_weights(self) -> None:
        self.served_weights_touched = True


class WorkerWeights:
    """One worker's weight state and the only code that changes it."""

    def __init__(self) -> None:
        self.state = WeightState()

    @contextmanager
    def applying(self, version: int, fingerprint: str | None) -> Iterator[WriteGuard]:
        """applying(v -> version) for the duration of the block; idle(version) from storage
        ``fingerprint`` when it ends normally. When it raises: back to the state before if
        the served parameters were not touched yet (a refused manifest, a failed copy into
        buffers of the worker's own), else needs_full."""
        before = self.state
        self.state = before.begin(version)
        guard = WriteGuard()
        try:
            yield guard
        except BaseException as exc:
            if guard.served_weights_touched:
                self.state = before.needs_full(
                    f"applying version {version} failed part-way ({type(exc).__name__}: {exc})"
                )
            else:
                self.state = before
            raise
        self.state = self.state.commit(fingerprint)

    def weights_dropped(self, reason: str) -> None:
        """The served parameters are gone or unknown (level-2 sleep): needs_full."""
        self.state = self.state.needs_full(reason)
