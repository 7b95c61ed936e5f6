"""Checks a weight manifest against the model and the generator's state before any worker
touches it, so a bad manifest is rejected whole and the current weights keep serving.

What is checked here (cheap, protobuf only): the publisher, the version order, the
fingerprint of a version-only manifest, and for a full manifest every name, global shape and
dtype against the model's checkpoint. How the shards tile each tensor and whether their
storage can be opened is checked by the weights receiver inside the workers
(``podrl.weights``), which raises the same ``ManifestError``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from podrl.generator.model_files import CheckpointTensor
from podrl.v1 import weights_pb2
from podrl.weights.dtypes import CASTABLE_FLOAT_DTYPES, from_wire, wire_name
from podrl.weights.errors import ManifestError, ManifestErrorKind


@dataclass(frozen=True)
class AppliedWeights:
    """What the generator serves now."""

    version: int
    """Policy version (0: the weights loaded from the model folder)."""
    fingerprint: str | None
    """Fingerprint of the last full manifest applied, None before the first."""


def check_manifest(
    manifest: weights_pb2.WeightManifest,
    applied: AppliedWeights,
    expected: Mapping[str, CheckpointTensor],
    trusted_publisher_id: str,
) -> None:
    """Raise ``ManifestError`` if ``manifest`` must not be applied; return None if it may."""
    if manifest.publisher_id != trusted_publisher_id:
        raise ManifestError(
            ManifestErrorKind.UNTRUSTED,
            f"publisher_id {manifest.publisher_id!r} is not this pod's trainer "
            f"({trusted_publisher_id!r}); set generator.trusted_publisher_id if the trainer "
            "runs under another worker id",
        )
    if manifest.version <= applied.version:
        raise ManifestError(
            ManifestErrorKind.STALE_VERSION,
            f"version {manifest.version} is not newer than the version being served "
            f"({applied.version}); publish a newer version",
        )
    if manifest.version_only:
        if manifest.shards:
            raise ManifestError(
                ManifestErrorKind.SHAPE, "a version-only manifest must not carry shards"
            )
        if applied.fingerprint is None or manifest.model_fingerprint != applied.fingerprint:
            raise ManifestError(
                ManifestErrorKind.FINGERPRINT,
                f"version-only manifest for fingerprint {manifest.model_fingerprint!r}, but the "
                f"generator holds {applied.fingerprint!r}; publish a full manifest",
            )
        return
    _check_full_manifest(manifest, expected)


def _check_full_manifest(
    manifest: weights_pb2.WeightManifest, expected: Mapping[str, CheckpointTensor]
) -> None:
    if not manifest.model_fingerprint:
        raise ManifestError(ManifestErrorKind.FINGERPRINT, "model_fingerprint is empty")
    seen: set[str] = set()
    for shard in manifest.shards:
        want = expected.get(shard.name)
        if want is None:
            raise ManifestError(
                ManifestErrorKind.UNKNOWN_NAME,
                f"shard {shard.name!r} names no parameter of the model (Hugging Face names "
                f"expected, e.g. {next(iter(expected))!r})",
                name=shard.name,
            )
        if tuple(shard.global_shape) != want.shape:
            raise ManifestError(
                ManifestErrorKind.SHAPE,
                f"{shard.name}: global_shape {list(shard.global_shape)} != the model's "
                f"{list(want.shape)}",
                name=shard.name,
            )
        dtype = from_wire(shard.dtype)
        if dtype is None or dtype not in CASTABLE_FLOAT_DTYPES:
            raise ManifestError(
                ManifestErrorKind.DTYPE,
                f"{shard.name}: dtype {wire_name(shard.dtype)} cannot be cast into the model's "
                f"{want.dtype} (publish float32, bfloat16 or float16)",
                name=shard.name,
            )
        seen.add(shard.name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ManifestError(
            ManifestErrorKind.MISSING_NAME,
            f"{len(missing)} parameter(s) have no shard, e.g. {missing[:3]}; a full manifest "
            "must cover the whole model",
            name=missing[0],
        )
