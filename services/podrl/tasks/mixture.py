"""Several tasks as one stream: each draw picks a task by weight, deterministically."""

from __future__ import annotations

import random
from collections.abc import Sequence

from podrl.tasks.base import Position, PositionError, PromptItem, TaskSource, position_int
from podrl.tasks.task_stream import TaskStream


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
