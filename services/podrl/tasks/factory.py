"""Build the run's task source from the ``tasks`` config section."""

from __future__ import annotations

from podrl.config.loading import ConfigError
from podrl.config.tasks import (
    JsonlSourceConfig,
    ProceduralSourceConfig,
    ReasoningGymSourceConfig,
    SourceConfig,
    TaskConfig,
    TasksConfig,
)
from podrl.tasks.task_stream import (
    Part,
    RecordStream,
    TaskMixture,
    TaskStream,
    TemplateError,
    derive_seed,
)


def build_records(config: TaskConfig, seed: int, field: str) -> RecordStream:
    return build_records_from(config.source, seed, f"{field}.source")


def build_records_from(source: SourceConfig, seed: int, field: str) -> RecordStream:
    """The record stream of ``source``; ``field`` names it in errors."""
    if isinstance(source, ReasoningGymSourceConfig):
        from podrl.tasks.reasoning_gym_source import ReasoningGymRecords

        return ReasoningGymRecords(source, seed, field)
    if isinstance(source, JsonlSourceConfig):
        from podrl.tasks.jsonl_source import JsonlRecords

        return JsonlRecords(source, seed, field)
    if isinstance(source, ProceduralSourceConfig):
        from podrl.tasks.procedural import ProceduralRecords

        return ProceduralRecords(source, seed)
    raise TypeError(f"unknown source config {type(source).__name__}")


def task_seed(config: TasksConfig, task: TaskConfig) -> int:
    """The seed of ``task``'s stream: its own ``seed``, else one derived from ``tasks.seed``."""
    return task.seed if task.seed is not None else derive_seed(config.seed, task.name)


def build_task_source(config: TasksConfig, part: Part = "train") -> TaskMixture:
    """A prompt stream of ``part`` of every task, mixed by weight.

    ``train`` (the RL run's stream): every task's training part. ``warm_start``: every task's
    warm-start part, or its training part when it has none (``split.warm_start`` 0).
    ``eval``: the evaluation prompts of the tasks that have them (``split.eval`` or
    ``eval_source``).

    Raises ConfigError naming the field when a source or template cannot be built, or when no
    task has evaluation prompts for ``part="eval"``.
    """
    streams = []
    weights = []
    for number, task in enumerate(config.definitions):
        if part == "eval" and not task.has_eval:
            continue
        field = f"tasks.definitions[{number}]"
        seed = task_seed(config, task)
        try:
            if part == "eval" and task.eval_source is not None:
                records = build_records_from(task.eval_source, seed, f"{field}.eval_source")
                streams.append(TaskStream(task, records, field, part=None))
            else:
                # A task without a warm-start part lends the warm-start its training part.
                own = "train" if part == "warm_start" and task.split.warm_start == 0 else part
                streams.append(TaskStream(task, build_records(task, seed, field), field, own))
        except (ValueError, TemplateError) as err:
            raise ConfigError(str(err)) from None
        weights.append(task.weight)
    if not streams:
        raise ConfigError(
            "tasks.definitions: no task has evaluation prompts; give one a held-out part "
            "(split: {eval: 0.1}) or an eval_source"
        )
    return TaskMixture(streams, weights, config.seed)
