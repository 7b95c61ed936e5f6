"""``make images`` from a fresh clone: clones this repository's HEAD into a new folder, gives it
the host's wheelhouse (``make wheelhouse`` output, hard-linked), and builds the base image and
every image of one variant there into an empty container store, so no layer comes from an
earlier build. Writes each step's time and each image's size to a JSON file
(bench/results/images_fresh_clone_<variant>.json, its table beside it; docs/kubernetes.md
states its figures).

    python bench/images_fresh_clone.py --variant cpu --wheelhouse wheelhouse/cpu

podman only (the empty store is a storage.conf of its own); the images stay in that store
until ``--keep`` is left out and the script removes it. The clone's ``make`` gets ``-o`` on the
virtualenv's stamp so it uses no virtualenv: an image build needs only the wheelhouse.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script (python bench/NAME.py): bench is a package

from bench import results_table  # noqa: E402

BASE_IMAGE = "localhost/podrl-python:3.11-bookworm"
BUILT = re.compile(r"^built (?P<ref>\S+) in (?P<seconds>\d+) s$", re.M)


def _storage_conf(folder: Path) -> Path:
    conf = folder / "storage.conf"
    conf.write_text(
        "[storage]\n"
        'driver = "overlay"\n'
        f'graphroot = "{folder / "storage"}"\n'
        f'runroot = "{folder / "run"}"\n'
    )
    return conf


def _make(clone: Path, env: dict[str, str], log: Path, *args: str) -> tuple[float, str]:
    """Runs ``make ARGS`` in the clone, its output appended to ``log``: (seconds, output)."""
    command = ["make", "-o", ".venv/.podrl-installed", *args]
    started = time.monotonic()
    done = subprocess.run(command, cwd=clone, env=env, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - started
    with open(log, "a") as out:
        out.write(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}); see {log}")
    return seconds, done.stdout


def _size_mb(ref: str, env: dict[str, str]) -> int:
    done = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Size}}", ref],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return round(int(done.stdout.strip()) / 1e6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--wheelhouse", type=Path, required=True, help="make wheelhouse's folder")
    parser.add_argument("--out", type=Path, default=None, help="the JSON file to write")
    parser.add_argument("--keep", action="store_true", help="keep the clone and its store")
    args = parser.parse_args()
    wheels = args.wheelhouse.resolve()
    if not (wheels / ".complete").is_file():
        sys.exit(f"{wheels} lacks .complete: run make wheelhouse VARIANT={args.variant}")
    out = args.out or REPO / "bench" / "results" / f"images_fresh_clone_{args.variant}.json"
    folder = Path(tempfile.mkdtemp(prefix="podrl-fresh-clone-"))
    clone = folder / "clone"
    log = folder / "build.log"
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    stamp = results_table.stamp()  # the start: date, and the commit the clone checks out
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
    subprocess.run(["git", "checkout", "--quiet", commit], cwd=clone, check=True)
    target = clone / "wheelhouse" / args.variant
    target.parent.mkdir()
    shutil.copytree(wheels, target, copy_function=os.link)
    # Newer than the clone's pyproject.toml, so make does not rebuild the wheelhouse.
    (target / ".complete").touch()
    env = {**os.environ, "CONTAINERS_STORAGE_CONF": str(_storage_conf(folder))}
    load = os.getloadavg()[0]
    try:
        base_seconds, _ = _make(clone, env, log, "base-image")
        images_seconds, output = _make(
            clone, env, log, "images", f"VARIANT={args.variant}", f"PYTHON_IMAGE={BASE_IMAGE}"
        )
        built = {m["ref"]: int(m["seconds"]) for m in BUILT.finditer(output)}
        result = {
            **stamp,
            "variant": args.variant,
            "engine": subprocess.run(
                ["podman", "--version"], capture_output=True, text=True, check=True
            ).stdout.strip(),
            "cpus": os.cpu_count(),
            "load_average_at_start": round(load, 1),
            "wheelhouse_wheels": len(list(wheels.glob("*.whl"))),
            "base_image": {"ref": BASE_IMAGE, "seconds": round(base_seconds),
                           "size_mb": _size_mb(BASE_IMAGE, env)},
            "images": [
                {"ref": ref, "seconds": seconds, "size_mb": _size_mb(ref, env)}
                for ref, seconds in built.items()
            ],
            "images_seconds": round(images_seconds),
        }  # fmt: skip
        out.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        results_table.update("images_fresh_clone", out)
    finally:
        if not args.keep:
            # The store is a folder of its own: removing it removes every image built here
            # (`podman system reset` would also remove the host's networks, kept outside it).
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
