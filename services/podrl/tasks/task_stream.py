"""One task as a TaskSource: its record stream with the task's templates applied."""

from __future__ import annotations

from podrl.config.tasks import TaskConfig
from podrl.tasks.base import Position, PromptItem, TaskSource, position_int
from podrl.tasks.records import RecordStream
from podrl.tasks.split import Part, part_of
from podrl.tasks.templates import PromptTemplate

#: Records a stream may skip in a row (their prompts lie in other parts) before it gives up.
MAX_SKIPPED = 100_000


class TaskStream(TaskSource):
    """Items ``{task}/{index}`` (``{task}/{part}/{index}`` outside the training part) for the
    records whose prompt lies in ``part`` (``tasks.definitions[i].split``); the position is the
    next record index. ``part=None`` takes every record (a source of its own, e.g. the task's
    ``eval_source``)."""

    def __init__(
        self,
        config: TaskConfig,
        records: RecordStream,
        field: str,
        part: Part | None = "train",
    ) -> None:
        self._config, self._records, self._field = config, records, field
        self._part = part
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
        name = self._config.name
        label = "" if self._part == "train" else f"{self._part or 'eval'}/"
        return PromptItem(
            id=f"{name}/{label}{index}",
            task=name,
            prompt=self._template.render(variables),
            reference=record.answer,
            target=self._target.render({"answer": record.answer}),
            metadata=dict(record.metadata),
        )

    def _in_part(self, item: PromptItem) -> bool:
        return self._part is None or part_of(item.task, item.prompt, self._config.split) == (
            self._part
        )

    def next_prompts(self, n: int) -> list[PromptItem]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        items: list[PromptItem] = []
        skipped = 0
        while len(items) < n:
            item = self.item(self._next)
            self._next += 1
            if self._in_part(item):
                items.append(item)
                skipped = 0
                continue
            skipped += 1
            if skipped >= MAX_SKIPPED:
                raise ValueError(
                    f"{self._field}.split: none of {MAX_SKIPPED} records in a row has a prompt in "
                    f"the {self._part} part; the task's prompt space is too small for this split "
                    "(lower split.eval / split.warm_start or widen the source)"
                )
        return items

    def position(self) -> Position:
        return {"index": self._next}

    def restore(self, position: Position) -> None:
        self._next = position_int(position, "index", f"task {self._config.name}")
