"""The generator's own checks of a weight manifest, before any worker is asked to apply it.

Only the generator knows what it serves, so the version order is checked here (versions can
also come from ``apply_checkpoint``, which the weights receiver never sees). Everything about
the manifest's content (publisher, names, shapes, dtypes, tiling, storage) is checked by
``podrl.weights.WeightReceiver`` inside the workers, which opens every handle before it copies
anything. Either way a rejected manifest leaves the served weights untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind


@dataclass(frozen=True)
class AppliedWeights:
    """What the generator serves now."""

    version: int
    """Policy version (0: the weights loaded from the model folder)."""
    fingerprint: str | None
    """Fingerprint of the last full manifest applied, None before the first."""


def check_manifest_order(manifest: weights_pb2.WeightManifest, applied: AppliedWeights) -> None:
    """Raise ``ManifestError`` (FAILED_PRECONDITION kinds) for a stale or out-of-order version
    or a version-only manifest for storage this generator does not hold."""
    if manifest.version <= applied.version:
        raise ManifestError(
            ManifestErrorKind.STALE_VERSION,
            f"version {manifest.version} is not newer than the version being served "
            f"({applied.version}); publish a newer version",
        )
    if manifest.version_only and (
        applied.fingerprint is None or manifest.model_fingerprint != applied.fingerprint
    ):
        raise ManifestError(
            ManifestErrorKind.FINGERPRINT,
            f"version-only manifest for fingerprint {manifest.model_fingerprint[:12]!r}, but the "
            f"generator holds {applied.fingerprint and applied.fingerprint[:12]!r}; publish a "
            "full manifest",
        )
