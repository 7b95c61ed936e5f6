"""Held-out evaluation: how well the policy answers prompts it never trains on.

``loop.eval_prompts`` distinct prompts are drawn once, at start, from the tasks' evaluation parts
(``tasks.definitions[i].split.eval``, or a task's ``eval_source``;
``podrl.tasks.task_stream.part_of``), so every evaluation asks the same questions and the RL stream
(the training parts) never holds one of them. The training source is not touched: a run with
evaluation draws exactly the training prompts of the same run without it.

An evaluation generates one greedy completion per prompt (temperature 0, top-p 1, no top-k,
``n = 1``, the loop's ``max_tokens`` and ``stop``) on the generators, which serve the trainer's
current policy version, scores them on the graders with the task's rewards, and trains nothing.
This greedy sampling is the evaluation's own: the loop's sampling (and the config rules that
refuse temperature 0 for it, docs/config.md) is not changed.

Figures of one evaluation (a record in ``/v1/evals``, ``summary.json``, the dashboard,
``/metrics`` and the tracking writers):

- ``accuracy``: the share of validly scored prompts whose reward is at least the task's
  ``pass_threshold`` (default 1.0: for the demo's rewards, an exactly right answer);
- ``reward_mean``: the mean reward of the validly scored prompts;
- both per task in ``by_task``; ``score_errors`` counts prompts whose scoring failed (left out of
  both figures, as in training);
- for a task played as episodes (it names an environment), whether the rise comes from the tool:
  ``tool_call_rate`` (the share of scored episodes that made at least one tool call),
  ``accuracy_with_tool`` and ``accuracy_without_tool`` (accuracy among the episodes with a tool
  call and among those without; None when there are none), ``tool_calls`` and ``tool_errors``
  (calls made and calls that failed), in ``tool_use`` and per task in ``by_task``; an evaluation
  without episodes has no ``tool_use``;
- ``step`` / ``policy_version``: after which step, and with which weights (step 0 = before the
  first step); ``when``: initial, periodic or final.

When: before the first step, after every ``loop.eval_every``-th step, and when the run has
finished. A failed evaluation (a generator or grader failed) is tried again like a step, up to
``loop.max_step_attempts`` times, then recorded with its ``error`` and no figures; it never fails
the run. Completions go to ``<run_dir>/eval_samples.jsonl``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from podrl.config import ConfigError, RunConfig
from podrl.config.loop import SamplingConfig
from podrl.config.tasks import TasksConfig
from podrl.controller.records.recorder import SampleLog
from podrl.controller.step.batch import StepSamples, is_valid, sample_id
from podrl.controller.step_errors import StepFailedError
from podrl.tasks import PromptItem, build_task_source
from podrl.v1 import common_pb2, grader_pb2

log = logging.getLogger(__name__)


class EvalView(BaseModel):
    """One evaluation as /v1/evals serves it."""

    model_config = ConfigDict(extra="allow")

    step: int = Field(description="Evaluated after this step (0 = before the first step).")
    policy_version: int
    when: str = Field(description="initial, periodic or final.")
    prompts: int = Field(description="Evaluation prompts asked.")
    accuracy: float | None = Field(description="Share of scored prompts that passed.")
    reward_mean: float | None
    scored: int | None = None
    passed: int | None = None
    score_errors: int | None = None
    by_task: dict[str, dict[str, Any]] = Field(default_factory=dict)
    seconds: float
    finished_at: float
    error: str | None = None


def greedy_sampling(sampling: SamplingConfig) -> SamplingConfig:
    """One greedy completion per prompt with the loop's length limit and stop strings.

    Built without validation on purpose: ``SamplingConfig`` requires ``n >= 2`` (a GRPO group)
    and the config rules refuse temperature 0 for the loop; neither applies here."""
    return SamplingConfig.model_construct(
        n=1,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        max_tokens=sampling.max_tokens,
        stop=list(sampling.stop),
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class _ToolUse:
    """Tool-call counts of scored episodes: how many called a tool, and who passed."""

    def __init__(self) -> None:
        self.episodes = self.with_tool = self.passed_with = self.passed_without = 0
        self.calls = self.errors = 0

    def add(self, turns: list[dict[str, Any]], ok: bool) -> None:
        calls = sum(turn["tool_calls"] for turn in turns)
        self.episodes += 1
        self.calls += calls
        self.errors += sum(turn["tool_errors"] for turn in turns)
        self.with_tool += calls > 0
        self.passed_with += ok and calls > 0
        self.passed_without += ok and not calls

    def absorb(self, other: _ToolUse) -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)

    def figures(self) -> dict[str, Any]:
        without = self.episodes - self.with_tool
        return {
            "episodes": self.episodes,
            "tool_call_rate": self.with_tool / self.episodes if self.episodes else None,
            "accuracy_with_tool": self.passed_with / self.with_tool if self.with_tool else None,
            "accuracy_without_tool": self.passed_without / without if without else None,
            "tool_calls": self.calls,
            "tool_errors": self.errors,
        }


def score_evaluation(data: StepSamples, thresholds: dict[str, float]) -> dict[str, Any]:
    """The figures of one evaluation from its (one-sample) groups and their scores. Pure."""
    by_task: dict[str, dict[str, Any]] = {}
    rewards: list[float] = []
    passed = errors = 0
    tools: dict[str, _ToolUse] = {}
    for item, sample in data.all_samples():
        score = data.score_of(item.id, sample)
        task = by_task.setdefault(item.task, {"prompts": 0, "passed": 0, "rewards": []})
        task["prompts"] += 1
        if not is_valid(score):
            errors += 1
            continue
        ok = score.reward >= thresholds[item.task]
        rewards.append(score.reward)
        task["rewards"].append(score.reward)
        task["passed"] += ok
        passed += ok
        turns = data.turns.get(sample_id(item.id, sample.index))
        if turns is not None:  # an episode: its environment's turns
            tools.setdefault(item.task, _ToolUse()).add(turns, ok)
    for name, task in by_task.items():
        scored = task.pop("rewards")
        task["scored"] = len(scored)
        task["reward_mean"] = _mean(scored)
        task["accuracy"] = task["passed"] / len(scored) if scored else None
        if name in tools:
            task["tool_use"] = tools[name].figures()
    tool_use: dict[str, Any] = {}
    if tools:
        every = _ToolUse()
        for part in tools.values():
            every.absorb(part)
        tool_use = {"tool_use": every.figures()}
    return {
        **tool_use,
        "prompts": len(data.items),
        "scored": len(rewards),
        "passed": passed,
        "score_errors": errors,
        "accuracy": passed / len(rewards) if rewards else None,
        "reward_mean": _mean(rewards),
        "by_task": by_task,
    }


def distinct_prompts(tasks: TasksConfig, count: int) -> list[PromptItem]:
    """The first ``count`` distinct prompts (by text) of the evaluation stream: a procedural
    source draws with repeats, and a prompt asked twice would count twice. ConfigError naming
    ``loop.eval_prompts`` when the evaluation parts hold fewer."""
    source = build_task_source(tasks, part="eval")
    items: dict[tuple[str, str], PromptItem] = {}
    draws = 0
    while len(items) < count and draws < 100 * count:
        for item in source.next_prompts(count):
            if len(items) < count:
                items.setdefault((item.task, item.prompt), item)
        draws += count
    if len(items) < count:
        raise ConfigError(
            f"loop.eval_prompts: {count} evaluation prompts asked, but the tasks' evaluation "
            f"parts gave only {len(items)} distinct ones in {draws} draws; lower "
            "loop.eval_prompts or raise tasks.definitions[i].split.eval"
        )
    return list(items.values())


#: Runs the generate and score phases of one evaluation attempt over ``data`` with the given
#: sampling (the loop supplies it: it knows the pods, and aligns the generators first).
RunPhases = Callable[[StepSamples, SamplingConfig], None]


class Evaluator:
    """The run's evaluation set and the evaluations run on it."""

    def __init__(self, config: RunConfig) -> None:
        loop = config.loop
        self.enabled = loop.eval_prompts > 0
        self.attempts = loop.max_step_attempts
        self.sampling = greedy_sampling(loop.sampling)
        self._thresholds = {task.name: task.pass_threshold for task in config.tasks.definitions}
        # Drawn once: every evaluation asks the same questions. Its own source object, so the
        # training stream's position never moves.
        self.items: list[PromptItem] = (
            distinct_prompts(config.tasks, loop.eval_prompts) if self.enabled else []
        )
        self.samples = SampleLog(config.run_dir, "eval_samples.jsonl")

    def evaluate(
        self,
        step: int,
        policy_version: int,
        when: str,
        run_phases: RunPhases,
        wait: Callable[[float], object] = time.sleep,
    ) -> dict[str, Any]:
        """One evaluation record, retried on a failed phase (module docstring)."""
        started = time.perf_counter()
        error: str | None = None
        figures: dict[str, Any] = {}
        for attempt in range(1, self.attempts + 1):
            data = StepSamples(items=list(self.items))
            try:
                run_phases(data, self.sampling)
            except StepFailedError as err:
                error = str(err)
                log.error(
                    "evaluation after step %d, attempt %d/%d failed: %s",
                    step,
                    attempt,
                    self.attempts,
                    err,
                )
                if attempt < self.attempts:
                    wait(min(2.0 * attempt, 10.0))
                continue
            figures, error = score_evaluation(data, self._thresholds), None
            self._write_samples(step, policy_version, data)
            break
        record: dict[str, Any] = {
            "step": step,
            "policy_version": policy_version,
            "when": when,
            "prompts": len(self.items),
            "accuracy": None,
            "reward_mean": None,
            **figures,
            "seconds": round(time.perf_counter() - started, 4),
            "finished_at": time.time(),
            "error": error,
        }
        if error is None:
            log.info(
                "evaluation after step %d (version %d): accuracy %s, mean reward %s",
                step,
                policy_version,
                _fmt(record["accuracy"]),
                _fmt(record["reward_mean"]),
            )
        return record

    def _write_samples(self, step: int, policy_version: int, data: StepSamples) -> None:
        def row(item: PromptItem, sample: common_pb2.Sample) -> dict[str, Any]:
            score = data.score_of(item.id, sample)
            valid = is_valid(score)
            return {
                "step": step,
                "policy_version": policy_version,
                "prompt_id": item.id,
                "task": item.task,
                "prompt": item.prompt,
                "reference": item.reference,
                "completion": sample.text,
                "reward": score.reward if valid else None,
                "passed": valid and score.reward >= self._thresholds[item.task],
                "score_error": None if valid else grader_pb2.ScoreError.Name(score.error),
            }

        self.samples.write(row(item, sample) for item, sample in data.all_samples())


def _fmt(value: float | None) -> str:
    return "unknown" if value is None else f"{value:.3f}"
