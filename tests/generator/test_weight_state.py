"""The generator's weight state machine (podrl.generator.worker_extension), without vLLM."""

from __future__ import annotations

import grpc
import pytest

from podrl.generator.worker_extension import (
    NEEDS_FULL_HINT,
    Admission,
    WeightPhase,
    WeightsNotServableError,
    WeightState,
    WorkerWeights,
    combine,
)
from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind

STORAGE, OTHER_STORAGE = "a" * 64, "b" * 64


def manifest(
    version: int, fingerprint: str = STORAGE, version_only: bool = False
) -> weights_pb2.WeightManifest:
    return weights_pb2.WeightManifest(
        version=version, model_fingerprint=fingerprint, version_only=version_only
    )


def refused(
    state: WeightState, m: weights_pb2.WeightManifest, kind: ManifestErrorKind, **kw: bool
) -> str:
    with pytest.raises(ManifestError) as err:
        state.admit(m, **kw)
    assert err.value.kind is kind, err.value
    assert err.value.status_code == grpc.StatusCode.FAILED_PRECONDITION
    return str(err.value)


def applied(weights: WorkerWeights, m: weights_pb2.WeightManifest) -> None:
    assert weights.state.admit(m) is Admission.APPLY
    with weights.applying(m.version, m.model_fingerprint) as guard:
        guard.touching_served_weights()


def test_idle_orders_versions_and_leaves_the_storage_to_the_receiver() -> None:
    weights = WorkerWeights()
    assert weights.state == WeightState(WeightPhase.IDLE, 0)
    applied(weights, manifest(1))
    assert weights.state == WeightState(WeightPhase.IDLE, 1, STORAGE)

    assert weights.state.admit(manifest(1)) is Admission.UNCHANGED  # a lost reply, retried
    assert weights.state.admit(manifest(1, version_only=True)) is Admission.UNCHANGED
    refused(weights.state, manifest(1, OTHER_STORAGE), ManifestErrorKind.STALE_VERSION)
    refused(weights.state, manifest(0), ManifestErrorKind.STALE_VERSION)
    assert weights.state.admit(manifest(2, version_only=True)) is Admission.APPLY
    # Which storage a version-only manifest may name is checked once, by the receiver whose
    # copy plan reads it (tests/weights/test_bad_manifests.py): the state admits by version.
    assert weights.state.admit(manifest(2, OTHER_STORAGE, version_only=True)) is Admission.APPLY
    assert weights.state.admit(manifest(2, OTHER_STORAGE)) is Admission.APPLY


def test_rollback_takes_an_older_version_as_a_full_manifest_only() -> None:
    weights = WorkerWeights()
    applied(weights, manifest(5))
    refused(weights.state, manifest(3), ManifestErrorKind.STALE_VERSION)
    refused(
        weights.state, manifest(3, version_only=True), ManifestErrorKind.FINGERPRINT, rollback=True
    )
    assert weights.state.admit(manifest(3), rollback=True) is Admission.APPLY
    applied_rollback = manifest(3, OTHER_STORAGE)
    with weights.applying(3, applied_rollback.model_fingerprint):
        pass
    assert weights.state == WeightState(WeightPhase.IDLE, 3, OTHER_STORAGE)


def test_a_rollback_never_rewrites_the_served_version() -> None:
    """Before this check: rollback=True at the served version with other weights was accepted (the
    version stayed, the weights changed). A rollback must go to an older version, in every
    phase; the served version from other storage is stale, rollback or not."""
    weights = WorkerWeights()
    applied(weights, manifest(5))
    for version in (5, 6):
        message = refused(
            weights.state,
            manifest(version, OTHER_STORAGE),
            ManifestErrorKind.STALE_VERSION,
            rollback=True,
        )
        assert "older version" in message
    refused(weights.state, manifest(5, OTHER_STORAGE), ManifestErrorKind.STALE_VERSION)
    weights.weights_dropped("a level-2 sleep dropped the weights")
    refused(
        weights.state, manifest(5, OTHER_STORAGE), ManifestErrorKind.STALE_VERSION, rollback=True
    )
    assert weights.state.admit(manifest(4, OTHER_STORAGE), rollback=True) is Admission.APPLY


def test_a_failure_before_the_served_weights_are_touched_keeps_the_previous_version() -> None:
    weights = WorkerWeights()
    applied(weights, manifest(1))
    before = weights.state
    with (
        pytest.raises(RuntimeError, match="copy into the worker's buffers"),
        weights.applying(2, STORAGE),
    ):
        assert weights.state.phase is WeightPhase.APPLYING
        assert weights.state.target == 2
        raise RuntimeError("copy into the worker's buffers failed")
    assert weights.state == before
    weights.state.require_servable()
    assert weights.state.admit(manifest(2, version_only=True)) is Admission.APPLY


def test_a_failure_after_the_served_weights_were_touched_needs_a_full_manifest() -> None:
    weights = WorkerWeights()
    applied(weights, manifest(1))
    with pytest.raises(RuntimeError), weights.applying(2, STORAGE) as guard:
        guard.touching_served_weights()
        raise RuntimeError("vLLM's reload failed half-way")
    state = weights.state
    assert state.phase is WeightPhase.NEEDS_FULL
    assert state.version == 1 and state.fingerprint is None
    assert "half-way" in state.reason
    with pytest.raises(WeightsNotServableError, match=NEEDS_FULL_HINT):
        state.require_servable()
    # Not the cached plan, not the same version-only retry: a full manifest.
    message = refused(state, manifest(2, version_only=True), ManifestErrorKind.FINGERPRINT)
    assert NEEDS_FULL_HINT in message and "half-way" in message
    refused(state, manifest(0), ManifestErrorKind.STALE_VERSION)
    assert state.admit(manifest(1)) is Admission.APPLY  # the last good version, written again
    # A failure that touches nothing leaves needs_full as it was.
    with pytest.raises(RuntimeError), weights.applying(2, STORAGE):
        raise RuntimeError("storage gone")
    assert weights.state == state
    applied(weights, manifest(2))
    assert weights.state == WeightState(WeightPhase.IDLE, 2, STORAGE)


def test_a_dropped_weight_set_needs_a_full_manifest_of_the_same_version_or_newer() -> None:
    weights = WorkerWeights()
    applied(weights, manifest(4))
    weights.weights_dropped("a level-2 sleep dropped the weights")
    assert weights.state.phase is WeightPhase.NEEDS_FULL and weights.state.version == 4
    refused(weights.state, manifest(4, version_only=True), ManifestErrorKind.FINGERPRINT)
    assert weights.state.admit(manifest(4)) is Admission.APPLY


def test_combine_agrees_or_needs_full() -> None:
    a = WeightState(WeightPhase.IDLE, 3, STORAGE)
    assert combine([a, a]) == a
    mixed = combine([a, WeightState(WeightPhase.IDLE, 2, STORAGE)])
    assert mixed.phase is WeightPhase.NEEDS_FULL and mixed.version == 2
    assert "disagree" in mixed.reason
    with pytest.raises(ValueError):
        combine([])


def test_state_crosses_collective_rpc_as_plain_values() -> None:
    state = WeightState(WeightPhase.NEEDS_FULL, 7, None, None, "why")
    wire = state.to_wire()
    assert all(isinstance(v, str | int | type(None)) for v in wire.values())
    assert WeightState.from_wire(wire) == state
    applying = WeightState(WeightPhase.IDLE, 7, STORAGE).begin(8)
    assert WeightState.from_wire(applying.to_wire()) == applying
