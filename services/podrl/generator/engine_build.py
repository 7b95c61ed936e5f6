"""Building vLLM's engine for the generator: where its engine core runs, the environment
vLLM's processes read, and the engine arguments taken from the ``generator:`` config section.

Runs once, at start, on the engine's loop thread (``VllmEngine.start``): vLLM's CPU worker
binds the calling thread's OpenMP threads, and both engines need a running event loop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from podrl.config.generator import GeneratorConfig
from podrl.generator import cpu_linear
from podrl.generator.cpu_linear import CPU_LINEAR_ENV
from podrl.generator.engine_runtime import InlineEngine
from podrl.generator.vllm_plugin import IDLE_SPIN_ENV

WORKER_EXTENSION = "podrl.generator.worker_extension.PodrlWorkerExtension"
"""The class vLLM mixes into its workers (``worker_extension_cls``); read at each build."""
CPU_IDLE_SPIN_SECONDS = 0.05
"""generator.vllm_idle_spin_seconds when unset on CPU: a decoding step reads its next message
well within it, so generation itself still never sleeps between steps."""


def engine_core_placement(config: GeneratorConfig) -> str:
    """Where vLLM's engine core runs: ``in_process`` or ``separate_process``
    (``generator.engine_core``; auto is in_process on CPU)."""
    from vllm.platforms import current_platform

    if config.engine_core != "auto":
        return config.engine_core
    return "in_process" if current_platform.is_cpu() else "separate_process"


async def build_engine(config: GeneratorConfig, model_path: Path, engine_core: str) -> Any:
    """vLLM's ``AsyncLLM``, or with ``engine_core`` in_process podrl's ``InlineEngine``, for
    ``model_path``; on the loop thread that will drive it."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform

    chunked_prefill = config.enable_chunked_prefill
    if chunked_prefill is None and current_platform.is_cpu():
        chunked_prefill = False  # see GeneratorConfig.enable_chunked_prefill
    idle_spin = config.vllm_idle_spin_seconds
    if idle_spin is None and current_platform.is_cpu():
        idle_spin = CPU_IDLE_SPIN_SECONDS
    if idle_spin is not None:
        # Read by podrl.generator.vllm_plugin in the engine processes vLLM spawns.
        os.environ[IDLE_SPIN_ENV] = repr(float(idle_spin))
    # Plain CPU linear weights: this process loads the model when the engine core runs in
    # it (the patch is made here; vLLM may have loaded its plugins already). vLLM's own
    # engine-core and worker processes keep vLLM's kernels (measured: they never ran the
    # plugin's patch), so there auto resolves to repack.
    if current_platform.is_cpu() and engine_core == "in_process":
        os.environ[CPU_LINEAR_ENV] = config.cpu_linear_weights
        cpu_linear.apply_from_environment()
    else:
        os.environ.pop(CPU_LINEAR_ENV, None)
    args = AsyncEngineArgs(
        model=str(model_path),
        dtype=config.dtype,
        tensor_parallel_size=config.tensor_parallel_size,
        max_model_len=config.max_model_len,
        kv_cache_memory_bytes=config.kv_cache_memory_bytes,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager,
        seed=config.seed,
        max_num_seqs=config.max_num_seqs,
        enable_chunked_prefill=chunked_prefill,
        logprobs_mode=config.logprobs_mode,
        enable_sleep_mode=config.enable_sleep_mode,
        worker_extension_cls=WORKER_EXTENSION,
    )
    if engine_core == "in_process":
        return InlineEngine.from_engine_args(args)
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(args)
