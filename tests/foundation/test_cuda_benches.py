"""The benchmarks that run on CPU and on the GPU machine (``--device cuda``) give both devices
the same workload: bench/scaling.py (docs/scaling.md, "Measured") and bench/async_vs_sync.py
(docs/controller.md, "Asynchronous mode")."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench import async_vs_sync
from bench.scaling import _config
from podrl.config import load_config
from podrl.config.run_config import RunConfig


def _loaded(tmp_path: Path, device: str) -> RunConfig:
    args = argparse.Namespace(device=device, steps=24, prompts=6, group=4)
    return load_config(_config(tmp_path, tmp_path / "tiny", 3, device, args), env={})


def test_the_cuda_run_shares_one_gpu_over_gloo_with_the_cpu_runs_workload(tmp_path: Path) -> None:
    cpu, cuda = _loaded(tmp_path, "cpu"), _loaded(tmp_path, "cuda")
    assert (cpu.device, cuda.device) == ("cpu", "cuda")
    assert cuda.trainer.replication.backend == "gloo"  # NCCL: one rank per GPU
    assert cuda.generator.dtype == "bfloat16" and cuda.generator.enforce_eager
    assert cuda.generator.engine_core == "auto"  # vLLM's own engine process off CPU
    # Three engines fit beside each other: each asks vLLM for a fifth of the GPU at most.
    assert cuda.generator.gpu_memory_utilization * 3 < 1
    for field in ("steps", "prompts_per_step", "sampling"):
        assert getattr(cpu.loop, field) == getattr(cuda.loop, field)
    assert cpu.controller.min_worker_pods == cuda.controller.min_worker_pods == 3


def test_the_async_bench_runs_the_demo_on_either_device_with_the_same_loop(tmp_path: Path) -> None:
    args = argparse.Namespace(steps=100, eval_every=50, seed=0, weight_apply="between_batches")
    loaded = {}
    for device in ("cpu", "cuda"):
        args.device = device
        path = async_vs_sync._config(tmp_path, tmp_path / "warm", "async", device, args)
        loaded[device] = load_config(path, env={})
    cpu, cuda = loaded["cpu"], loaded["cuda"]
    assert (cpu.device, cuda.device) == ("cpu", "cuda")
    assert (cpu.generator.dtype, cuda.generator.dtype) == ("float32", "bfloat16")
    assert cpu.loop == cuda.loop
    assert cuda.loop.mode == "async" and cuda.loop.max_staleness == 1


def test_the_async_bench_runs_in_flight_weight_updates_when_asked(tmp_path: Path) -> None:
    args = argparse.Namespace(
        steps=100, eval_every=50, seed=0, weight_apply="in_flight", device="cpu"
    )
    path = async_vs_sync._config(tmp_path, tmp_path / "warm", "async", "in-flight", args)
    assert load_config(path, env={}).loop.weight_apply == "in_flight"
    path = async_vs_sync._config(tmp_path, tmp_path / "warm", "sync", "sync", args)
    assert load_config(path, env={}).loop.weight_apply == "between_batches"
