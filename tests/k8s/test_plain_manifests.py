"""k8s/ holds the chart rendered by podrl.tools.render_k8s; it must not drift, and it must be
valid for every Kubernetes version the chart supports in that mode."""

from __future__ import annotations

import pytest

from podrl.tools.render_k8s import (
    MANIFEST_DIR,
    VARIANTS,
    parse_objects,
    render_variant,
    stale_files,
)
from tests.k8s.manifests import KUBE_VERSIONS, validation_error


def test_k8s_manifests_match_the_chart() -> None:
    assert stale_files() == [], "k8s/ drifted from helm/podrl: run `make k8s` and commit"


def test_drift_is_detected(tmp_path) -> None:
    for variant in VARIANTS:
        (tmp_path / variant.filename).write_text(render_variant(variant))
    assert stale_files(tmp_path) == []
    edited = tmp_path / VARIANTS[0].filename
    edited.write_text(edited.read_text().replace("replicas: 1", "replicas: 3", 1))
    assert stale_files(tmp_path) == [VARIANTS[0].filename]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS, ids=[v.filename for v in VARIANTS])
def test_k8s_manifests_validate_strictly(variant, kube_version: str) -> None:
    objects = parse_objects((MANIFEST_DIR / variant.filename).read_text())
    assert objects
    assert not [o for o in objects if o["kind"] == "Pod"], "helm test pods stay out of k8s/"
    for obj in objects:
        assert obj["metadata"]["namespace"] == "podrl"
        error = validation_error(obj, kube_version)
        assert error is None, f"{obj['kind']}/{obj['metadata']['name']}: {error}"
