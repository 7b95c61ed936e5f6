"""Rendering the chart and reading the rendered objects (helpers for the tests in this folder)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import kubernetes_validate

from podrl.tools.render_k8s import helm_template, parse_objects

KUBE_VERSIONS = ("1.34.0", "1.35.0", "1.37.0")
GPU_CONTAINERS = ("trainer", "generator", "grader")
RELEASE = "podrl"
NAMESPACE = "podrl"


@dataclass(frozen=True)
class Case:
    """One point of the values matrix."""

    gpu_mode: str
    workers: int
    expandable_segments: bool
    kube_version: str

    @property
    def values(self) -> dict[str, Any]:
        return {
            "gpu": {"mode": self.gpu_mode},
            "workers": {
                "replicas": self.workers,
                "expandableSegments": {"enabled": self.expandable_segments},
            },
        }

    @property
    def id(self) -> str:
        ptrace = "expseg" if self.expandable_segments else "noexpseg"
        return f"{self.gpu_mode}-w{self.workers}-{ptrace}-k{self.kube_version}"


MATRIX = tuple(
    Case(mode, workers, expandable, kube)
    for mode in ("dra", "devicePlugin")
    for workers in (0, 1, 4)
    for expandable in (False, True)
    for kube in KUBE_VERSIONS
)


@functools.cache
def _render_cached(values_json: str, kube_version: str, skip_tests: bool) -> tuple[dict, ...]:
    text = helm_template(json.loads(values_json), kube_version=kube_version, skip_tests=skip_tests)
    return tuple(parse_objects(text))


def render(
    values: dict[str, Any] | None = None, kube_version: str = "1.35.0", skip_tests: bool = False
) -> list[dict[str, Any]]:
    """The chart's objects for these values, rendered and parsed once per distinct input.

    The objects are shared between tests: read them, do not modify them.
    """
    return list(_render_cached(json.dumps(values or {}, sort_keys=True), kube_version, skip_tests))


@functools.cache
def _validation_error(obj_json: str, kube_version: str) -> str | None:
    try:
        kubernetes_validate.validate(json.loads(obj_json), kube_version, strict=True)
    except kubernetes_validate.ValidationError as err:
        return err.message
    return None


def validation_error(obj: dict[str, Any], kube_version: str) -> str | None:
    """Strict validation against the official schema of ``kube_version``; None if it passes.

    Cached per distinct object: most objects do not change across the values matrix.
    """
    return _validation_error(json.dumps(obj, sort_keys=True), kube_version)


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [
        o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def kinds(objects: list[dict[str, Any]]) -> list[str]:
    return sorted(o["kind"] for o in objects)


def pod_specs(objects: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(owner name, pod spec) of every workload and bare pod."""
    for obj in objects:
        if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            yield obj["metadata"]["name"], obj["spec"]["template"]["spec"]
        elif obj["kind"] == "Pod":
            yield obj["metadata"]["name"], obj["spec"]


def worker_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return find(objects, "StatefulSet", f"{RELEASE}-worker")["spec"]["template"]["spec"]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod["containers"] if c["name"] == name]
    return found


def env_map(spec: dict[str, Any], field_values: dict[str, str]) -> dict[str, str]:
    """A container's environment as the kubelet would set it (fieldRefs from field_values)."""
    env: dict[str, str] = {}
    for var in spec.get("env", []):
        if "value" in var:
            env[var["name"]] = str(var["value"])
        else:
            field = var["valueFrom"]["fieldRef"]["fieldPath"]
            env[var["name"]] = field_values[field]
    return env
