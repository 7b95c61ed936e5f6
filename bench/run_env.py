"""The environment of the ``podrl`` processes a benchmark starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# What a benchmark's run sets on the GPU machine besides ``device: cuda``, where the same run
# also goes on CPU: bf16 sampling, and eager layers in vLLM and the trainer, so each run starts
# in seconds (the benchmarks time steps, not the engine's start).
CUDA_GENERATOR: dict[str, object] = {"dtype": "bfloat16", "enforce_eager": True}
CUDA_TRAINER: dict[str, object] = {"compile_layers": False}


def set_steps(config: dict[str, Any], steps: int) -> None:
    """``loop.steps`` of a recipe set to ``steps``, its ``trainer.warmup_steps`` scaled with it
    (rounded down): a short rehearsal of a recipe keeps the warmup's share of the run, and a
    decaying schedule, which must end its warmup before the last step, still loads."""
    recipe_steps = config["loop"]["steps"]
    warmup = config.get("trainer", {}).get("warmup_steps")
    config["loop"]["steps"] = steps
    if warmup:
        config["trainer"]["warmup_steps"] = warmup * steps // recipe_steps


def pythonpath() -> str:
    """podrl's services and the repository first, then what the caller set (on the GPU
    machine: the carried wheels and vLLM, bench/vllm_device_env.sh)."""
    return os.pathsep.join(
        part
        for part in (str(REPO / "services"), str(REPO), os.environ.get("PYTHONPATH", ""))
        if part
    )


def podrl_env() -> dict[str, str]:
    """This process's environment with :func:`pythonpath` and wide log lines."""
    return {**os.environ, "PYTHONPATH": pythonpath(), "COLUMNS": "200"}


def gpu_name() -> dict[str, str]:
    """``{"gpu": name}`` when nvidia-smi answers, else nothing (a CPU machine)."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return {}
    names = done.stdout.strip()
    return {"gpu": names} if done.returncode == 0 and names else {}


def podrl_cli(*args: str) -> list[str]:
    """The command line of ``podrl ARGS`` in this interpreter."""
    return [sys.executable, "-m", "podrl.cli", *args]


def podrl_run(config: Path, log: Path, timeout: float) -> int | str:
    """``podrl run CONFIG`` with its output in ``log``: its exit code, or how long it ran
    before it was killed."""
    with open(log, "w") as out:
        try:
            done = subprocess.run(
                podrl_cli("run", str(config)), stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"timed out after {timeout:.0f} s"
    return done.returncode


def podrl_warm_start(
    config: Path, base: Path, out: Path, steps: int, lr: float
) -> subprocess.CompletedProcess[str]:
    """``podrl warm-start`` of ``base`` into ``out`` (its output captured; ten minutes at most)."""
    return subprocess.run(
        podrl_cli("warm-start", str(config), "--base", str(base), "--out", str(out),
                  "--steps", str(steps), "--lr", str(lr)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
