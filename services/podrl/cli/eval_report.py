"""What `podrl run` shows of the held-out evaluation: a progress row while the run goes, and at
the end the evaluation table (before and after RL) and the reward curve as text."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.progress import Progress, TaskID
from rich.table import Table

from podrl.config.loop import LoopConfig

SPARK = " ▁▂▃▄▅▆▇█"


def planned_evaluations(loop: LoopConfig) -> int:
    """Evaluations a run of ``loop.steps`` steps records: before the first step, after every
    ``eval_every``-th step, and at the end unless the last step was one of those."""
    if not loop.eval_prompts:
        return 0
    periodic = loop.steps // loop.eval_every if loop.eval_every else 0
    final = 0 if loop.eval_every and loop.steps % loop.eval_every == 0 else 1
    return 1 + periodic + final


class EvalProgress:
    """A progress row "held-out eval": evaluations done of those planned, the latest figures."""

    def __init__(self, progress: Progress, loop: LoopConfig) -> None:
        self._progress = progress
        self._task: TaskID | None = None
        total = planned_evaluations(loop)
        if total:
            self._task = progress.add_task("held-out eval", total=total, reward="-", phase="")

    def update(self, status: dict[str, Any]) -> None:
        if self._task is None:
            return
        last = status.get("last_eval") or {}
        accuracy = last.get("accuracy")
        self._progress.update(
            self._task,
            completed=status.get("evaluations", 0),
            reward="-" if accuracy is None else f"acc {accuracy:.3f}",
            phase="evaluating" if status.get("phase") == "evaluate" else "",
        )


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3f}"


#: The columns an evaluation of episodes adds: does the rise come from calling the tool?
TOOL_COLUMNS = (
    ("tool-call rate", "tool_call_rate"),
    ("accuracy with a call", "accuracy_with_tool"),
    ("accuracy without", "accuracy_without_tool"),
)


def eval_table(evaluations: list[dict[str, Any]]) -> Table:
    """Every evaluation of the run, the first (before RL) and the last (after it) marked; a run
    of episodes adds its tool-call rate and its accuracy with and without a tool call."""
    table = Table(title="held-out evaluation (greedy, prompts never trained on)")
    tools = any(evaluation.get("tool_use") for evaluation in evaluations)
    columns = ["after step", "policy version", "prompts", "accuracy", "mean reward"]
    for column in [*columns, *(name for name, _ in TOOL_COLUMNS if tools), "when"]:
        table.add_column(column)
    for evaluation in evaluations:
        when = escape(str(evaluation.get("when", "")))
        if evaluation.get("error"):
            when = f"{when}: failed ({escape(str(evaluation['error']))})"
        tool_use = evaluation.get("tool_use") or {}
        table.add_row(
            str(evaluation["step"]),
            str(evaluation["policy_version"]),
            str(evaluation["prompts"]),
            _fmt(evaluation.get("accuracy")),
            _fmt(evaluation.get("reward_mean")),
            *(_fmt(tool_use.get(key)) for _, key in TOOL_COLUMNS if tools),
            when,
        )
    return table


def reward_curve_text(steps: list[dict[str, Any]], width: int = 60) -> str:
    """The mean training reward per step as one line of bars (0 to 1), averaged into at most
    ``width`` buckets; steps whose reward is unknown are left out."""
    rewards = [
        s["metrics"]["reward_mean"] for s in steps if s["metrics"].get("reward_mean") is not None
    ]
    if not rewards:
        return "no measured reward"
    buckets = min(width, len(rewards))
    means = []
    for b in range(buckets):
        part = rewards[b * len(rewards) // buckets : (b + 1) * len(rewards) // buckets]
        means.append(sum(part) / len(part))
    bars = "".join(SPARK[max(0, min(len(SPARK) - 1, round(m * (len(SPARK) - 1))))] for m in means)
    return f"reward {means[0]:.2f} |{bars}| {means[-1]:.2f}  (steps 1-{len(steps)})"
