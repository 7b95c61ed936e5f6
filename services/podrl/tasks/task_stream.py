"""The prompt stream: a deterministic, resumable sequence of prompts drawn from the run's tasks.

What one draw passes through, in order: :class:`TaskMixture` picks the task by weight,
:class:`TaskStream` takes the task's next record (:class:`RecordStream`, implemented by each
source in ``podrl.tasks.*_source``/``procedural``), keeps it only when its prompt lies in the
stream's part of the task (:func:`part_of`: evaluation, warm-start or RL training, fixed by a
hash of the task name and the prompt text, so the parts never share a prompt whatever the
seeds), renders it through the task's templates (:class:`PromptTemplate`) and hands it on as a
:class:`PromptItem`. The position a stream saves is a handful of record indices and draw counts
(:class:`TaskSource`).
"""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from podrl.config.tasks import SplitConfig, TaskConfig
from podrl.v1 import grader_pb2

# ---- the items and the interface of a stream -------------------------------------------------


Position = dict[str, Any]
"""A source's place in its stream: plain JSON (ints, strings, nested dicts)."""


@dataclass(frozen=True)
class PromptItem:
    """One prompt drawn from a task, with what the grader needs to score its completions."""

    id: str
    """Unique within the run's stream, e.g. ``arith/17``; stable for the same seed."""
    task: str
    """The task name (ScoreItem.task)."""
    prompt: str
    """The prompt text with the task's template applied (what the generator sees)."""
    reference: str
    """The reference answer (ScoreItem.reference)."""
    target: str
    """The ideal completion (the task's target_template over the reference) for warm-starts."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Strings forwarded as ScoreItem.metadata (reward functions may read them)."""

    def score_item(self, completion: str, sample_id: str) -> grader_pb2.ScoreItem:
        """The ScoreItem asking the grader to score ``completion`` of this item.

        ``sample_id`` names this one completion; the grader echoes it in ``ItemScore.id``, which
        is how the caller maps each reply back (the controller passes its per-sample id,
        ``"{item.id}#{index}"``). Prompt, reference, task and metadata come from the item, so the
        grader sees exactly what the task source produced.
        """
        return grader_pb2.ScoreItem(
            id=sample_id,
            prompt=self.prompt,
            completion=completion,
            reference=self.reference,
            task=self.task,
            metadata=self.metadata,
        )


class TaskSource(ABC):
    """A deterministic prompt stream: the same seed gives the same items in the same order, and
    ``restore(position())`` continues exactly where the stream was (no repeats, no gaps)."""

    @property
    @abstractmethod
    def task_names(self) -> list[str]:
        """The task names this source can emit."""

    @abstractmethod
    def next_prompts(self, n: int) -> list[PromptItem]:
        """The next ``n`` items of the stream (advances the position)."""

    @abstractmethod
    def position(self) -> Position:
        """Where the stream is now, as a JSON-serialisable dict."""

    @abstractmethod
    def restore(self, position: Position) -> None:
        """Continue from ``position`` (a value ``position()`` returned, possibly after JSON)."""


class PositionError(ValueError):
    """A saved position that does not fit this source (another config, or corrupted)."""


def derive_seed(seed: int, name: str) -> int:
    """A stable 32-bit seed for ``name`` under the run seed (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def position_int(position: Position, key: str, source: str) -> int:
    value = position.get(key) if isinstance(position, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PositionError(
            f"{source}: saved position {position!r} has no non-negative integer {key!r}"
        )
    return value


# ---- records: a task's questions before its templates ----------------------------------------


@dataclass(frozen=True)
class Record:
    """A question and its reference answer before the task's template is applied."""

    question: str
    answer: str
    metadata: dict[str, str] = field(default_factory=dict)


class RecordStream(ABC):
    """An endless, deterministic sequence of records, addressed by index."""

    @abstractmethod
    def record(self, index: int) -> Record:
        """Record number ``index`` (>= 0); the same index always gives the same record."""


# ---- templates -------------------------------------------------------------------------------


class TemplateError(ValueError):
    """A template that cannot be rendered for an item (bad syntax or an unknown variable)."""


class PromptTemplate:
    """Renders a task's prompt from ``question``, ``task`` and the item's metadata fields.

    ``format``: Python ``str.format`` (``"{question}\\nAnswer: "``). ``jinja``: a Jinja2 template
    with undefined variables as errors (``"{{ question }}"``, loops, chat markup, ...).
    """

    def __init__(self, text: str, kind: Literal["format", "jinja"], field: str) -> None:
        self._text, self._kind, self._field = text, kind, field
        self._jinja = None
        if kind == "jinja":
            import jinja2  # only sources with Jinja templates need it

            env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
            try:
                self._jinja = env.from_string(text)
            except jinja2.TemplateSyntaxError as err:
                raise TemplateError(f"{field}: invalid Jinja template: {err}") from None

    def render(self, variables: Mapping[str, Any]) -> str:
        try:
            if self._jinja is not None:
                return self._jinja.render(**variables)
            return self._text.format(**variables)
        except (KeyError, IndexError, ValueError) as err:
            raise TemplateError(
                f"{self._field}: cannot render with variables {sorted(variables)}: {err!r}"
            ) from None
        except Exception as err:  # jinja2.UndefinedError and friends
            raise TemplateError(f"{self._field}: {err}") from None


# ---- parts of a task's prompt space ----------------------------------------------------------


Part = Literal["train", "warm_start", "eval"]
PARTS: tuple[Part, ...] = ("train", "warm_start", "eval")


def unit_hash(task: str, prompt: str) -> float:
    """A stable number in [0, 1) for (task, prompt) (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{task}\0{prompt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def part_of(task: str, prompt: str, split: SplitConfig) -> Part:
    """The part ``prompt`` of task ``task`` belongs to under ``split``."""
    u = unit_hash(task, prompt)
    if u < split.eval:
        return "eval"
    if u < split.eval + split.warm_start:
        return "warm_start"
    return "train"


# ---- one task, and several mixed -------------------------------------------------------------


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
            target=self._target.render({**record.metadata, "answer": record.answer}),
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


class TaskMixture(TaskSource):
    """Draw ``k`` comes from task ``choices(names, weights)`` of ``Random(f"{seed}:{k}")``, so a
    restored position continues with the same picks. Position: ``{"draws": k, "tasks": {name:
    task position}}``."""

    def __init__(self, tasks: Sequence[TaskStream], weights: Sequence[float], seed: int) -> None:
        if not tasks or len(tasks) != len(weights):
            raise ValueError("a task mixture needs one weight per task and at least one task")
        self._tasks = {task.task_names[0]: task for task in tasks}
        self._names = list(self._tasks)
        self._weights = list(weights)
        self._seed = seed
        self._draws = 0

    @property
    def task_names(self) -> list[str]:
        return list(self._names)

    def _pick(self, draw: int) -> str:
        if len(self._names) == 1:
            return self._names[0]
        rng = random.Random(f"{self._seed}:mixture:{draw}")
        return rng.choices(self._names, self._weights)[0]

    def next_prompts(self, n: int) -> list[PromptItem]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        items = []
        for draw in range(self._draws, self._draws + n):
            items.extend(self._tasks[self._pick(draw)].next_prompts(1))
        self._draws += n
        return items

    def position(self) -> Position:
        return {
            "draws": self._draws,
            "tasks": {name: task.position() for name, task in self._tasks.items()},
        }

    def restore(self, position: Position) -> None:
        draws = position_int(position, "draws", "task mixture")
        saved = position.get("tasks")
        if not isinstance(saved, dict) or set(saved) != set(self._names):
            got = sorted(saved) if isinstance(saved, dict) else saved
            raise PositionError(
                f"saved position names tasks {got}, but the config has {sorted(self._names)}; "
                "restore with the config the position was saved under"
            )
        for name, task in self._tasks.items():
            task.restore(saved[name])
        self._draws = draws
