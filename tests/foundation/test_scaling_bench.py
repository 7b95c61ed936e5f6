"""bench/scaling.py's runs: the CUDA one keeps the CPU one's workload and makes the pods that
share one GPU reduce over gloo (docs/scaling.md, "Measured")."""

from __future__ import annotations

import argparse
from pathlib import Path

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
    assert cuda.generator.dtype == "bfloat16"
    # Three engines fit beside each other: each asks vLLM for a fifth of the GPU at most.
    assert cuda.generator.gpu_memory_utilization * 3 < 1
    for field in ("steps", "prompts_per_step", "sampling"):
        assert getattr(cpu.loop, field) == getattr(cuda.loop, field)
    assert cpu.controller.min_worker_pods == cuda.controller.min_worker_pods == 3
