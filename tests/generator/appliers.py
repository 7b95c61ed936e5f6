"""A weight applier over stand-in workers, as the generator builds one: serving version 3 of
storage ``storage-a``, trusting publisher ``trainer-1`` with a fresh weights key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from podrl.config.generator import GeneratorConfig
from podrl.generator.engine_runtime import EngineLoop
from podrl.generator.weight_applier import UNSUPPORTED, WeightApplier
from podrl.generator.worker_extension import WeightPhase, WeightState
from podrl.weights.protocol import (
    WEIGHTS_KEY_FILE_ENV,
    GeneratorKey,
    WeightsKey,
    write_fresh_key_file,
)

SERVED = WeightState(WeightPhase.IDLE, 3, "storage-a")


def signed_applier(
    tmp_path: Path, config: GeneratorConfig, workers: Any, loop: EngineLoop
) -> tuple[WeightApplier, WeightsKey]:
    """The applier, and the key (written to ``tmp_path/key``) that signs the manifests it
    accepts. ``workers``: what stands in for vLLM's workers."""
    key = write_fresh_key_file(tmp_path / "key")
    applier = WeightApplier(
        config,
        workers,
        loop,
        state=SERVED,
        in_flight_apply=UNSUPPORTED,
        parameter_count=4,
        trusted_publisher_id="trainer-1",
        key=GeneratorKey({WEIGHTS_KEY_FILE_ENV: str(tmp_path / "key")}),
    )
    return applier, key
