"""Build the run's task source from the ``tasks`` config section."""

from __future__ import annotations

from podrl.config.loading import ConfigError
from podrl.config.tasks import (
    JsonlSourceConfig,
    ProceduralSourceConfig,
    ReasoningGymSourceConfig,
    TaskConfig,
    TasksConfig,
)
from podrl.tasks.base import derive_seed
from podrl.tasks.mixture import TaskMixture
from podrl.tasks.records import RecordStream
from podrl.tasks.task_stream import TaskStream
from podrl.tasks.templates import TemplateError


def build_records(config: TaskConfig, seed: int, field: str) -> RecordStream:
    source = config.source
    if isinstance(source, ReasoningGymSourceConfig):
        from podrl.tasks.reasoning_gym_source import ReasoningGymRecords

        return ReasoningGymRecords(source, seed, f"{field}.source")
    if isinstance(source, JsonlSourceConfig):
        from podrl.tasks.jsonl_source import JsonlRecords

        return JsonlRecords(source, seed, f"{field}.source")
    if isinstance(source, ProceduralSourceConfig):
        from podrl.tasks.procedural import ProceduralRecords

        return ProceduralRecords(source, seed)
    raise TypeError(f"unknown source config {type(source).__name__}")


def task_seed(config: TasksConfig, task: TaskConfig) -> int:
    """The seed of ``task``'s stream: its own ``seed``, else one derived from ``tasks.seed``."""
    return task.seed if task.seed is not None else derive_seed(config.seed, task.name)


def build_task_source(config: TasksConfig) -> TaskMixture:
    """The run's prompt stream: every task of ``config.definitions``, mixed by weight.

    Raises ConfigError naming the field when a source or template cannot be built.
    """
    streams = []
    for number, task in enumerate(config.definitions):
        field = f"tasks.definitions[{number}]"
        seed = task_seed(config, task)
        try:
            streams.append(TaskStream(task, build_records(task, seed, field), field))
        except (ValueError, TemplateError) as err:
            raise ConfigError(str(err)) from None
    return TaskMixture(streams, [task.weight for task in config.definitions], config.seed)
