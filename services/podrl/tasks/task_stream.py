"""One task as a TaskSource: its record stream with the task's templates applied."""

from __future__ import annotations

from podrl.config.tasks import TaskConfig
from podrl.tasks.base import Position, PromptItem, TaskSource, position_int
from podrl.tasks.records import RecordStream
from podrl.tasks.templates import PromptTemplate


class TaskStream(TaskSource):
    """Items ``{task}/{index}`` for index 0, 1, 2, ...; the position is the next index."""

    def __init__(self, config: TaskConfig, records: RecordStream, field: str) -> None:
        self._config, self._records = config, records
        self._template = PromptTemplate(
            config.template, config.template_format, f"{field}.template"
        )
        self._target = PromptTemplate(config.target_template, "format", f"{field}.target_template")
        self._next = 0
        self.item(0)  # a template that cannot render fails at construction, naming the field

    @property
    def task_names(self) -> list[str]:
        return [self._config.name]

    def item(self, index: int) -> PromptItem:
        record = self._records.record(index)
        variables = {**record.metadata, "question": record.question, "task": self._config.name}
        return PromptItem(
            id=f"{self._config.name}/{index}",
            task=self._config.name,
            prompt=self._template.render(variables),
            reference=record.answer,
            target=self._target.render({"answer": record.answer}),
            metadata=dict(record.metadata),
        )

    def next_prompts(self, n: int) -> list[PromptItem]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        items = [self.item(index) for index in range(self._next, self._next + n)]
        self._next += n
        return items

    def position(self) -> Position:
        return {"index": self._next}

    def restore(self, position: Position) -> None:
        self._next = position_int(position, "index", f"task {self._config.name}")
