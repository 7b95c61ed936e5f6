"""The run configuration: one typed model that drives local runs, docker-compose and Helm."""

from podrl.config.loading import ConfigError, load_config
from podrl.config.run_config import (
    ControllerConfig,
    GeneratorConfig,
    GraderConfig,
    GrpcConfig,
    LogConfig,
    RunConfig,
    TrainerConfig,
)

__all__ = [
    "ConfigError",
    "ControllerConfig",
    "GeneratorConfig",
    "GraderConfig",
    "GrpcConfig",
    "LogConfig",
    "RunConfig",
    "TrainerConfig",
    "load_config",
]
