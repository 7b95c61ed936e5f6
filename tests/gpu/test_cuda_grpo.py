"""Four services on one GPU: ``podrl run`` with the generator asleep during every Train
(bench/cuda_grpo.py; docs/cuda.md, section 5). Skipped without CUDA and vLLM.

On the GPU machine, after the vLLM carry calls (``source bench/vllm_device_env.sh``):
``python -m pytest tests/gpu/test_cuda_grpo.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

from bench.cuda_grpo import Options, run


def test_a_grpo_run_on_one_gpu_sleeps_the_generator_through_every_train(tmp_path: Path) -> None:
    results = run(
        Options(modes=("sleep_during_train",), steps=20, warm_steps=100, work_dir=tmp_path)
    )
    (one,) = results["runs"]
    assert one["exit_code"] == 0 and one["phase"] == "finished", one
    assert one["steps"] == 20 and one["steps_trained"] >= 1, one
    phases = one["phase_median_seconds"]
    # Sleep before each Train and WakeUp before its sync ran (each phase is timed when it runs).
    assert phases["sleep"] is not None and phases["wake"] is not None, phases
    assert one["final_eval"]["policy_version"] == one["steps_trained"], one["final_eval"]
