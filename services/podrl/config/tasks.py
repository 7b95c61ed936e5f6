"""Tasks section of the run config: what prompts the run draws and how their answers are scored.

The controller builds the task source from this section (``podrl.tasks.build_task_source``); the
grader builds one reward plan per task from the same section (``podrl.grader.rewards``), so both
sides agree on task names by construction.
"""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from podrl.config.base import Section

_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ReasoningGymSourceConfig(Section):
    """Prompts generated locally by a ``reasoning-gym`` dataset."""

    kind: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str = Field(
        min_length=1, description="reasoning-gym dataset name, e.g. basic_arithmetic, leg_counting."
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the dataset's config (reasoning_gym.create_dataset).",
    )
    chunk_size: int = Field(
        10_000,
        ge=1,
        description="Items per generated dataset chunk; each chunk gets a seed derived from the "
        "task seed and its number, so the stream never ends and stays deterministic.",
    )


class JsonlSourceConfig(Section):
    """Prompts read from a JSON-lines file, one object per line."""

    kind: Literal["jsonl"] = "jsonl"
    path: str = Field(min_length=1, description="The .jsonl file (relative to the working dir).")
    prompt_field: str = Field("question", min_length=1, description="Field holding the question.")
    answer_field: str = Field("answer", min_length=1, description="Field holding the reference.")
    id_field: str | None = Field(
        None, description="Field holding a stable row id; None uses the line number."
    )
    metadata_fields: list[str] = Field(
        default_factory=list,
        description="Fields copied into the item's metadata (and the template's variables).",
    )
    shuffle: bool = Field(True, description="Shuffle each pass over the file (seeded per epoch).")


class ProceduralSourceConfig(Section):
    """Tiny built-in procedural tasks with short answers (see docs/tasks.md).

    They exist for small models: a character-level model can learn them in minutes.
    """

    kind: Literal["procedural"] = "procedural"
    generator: Literal["add", "mul", "copy", "reverse"] = Field(
        description="add: 'a+b=' -> sum; mul: 'a*b=' -> product; copy: 'copy:abc=' -> abc; "
        "reverse: 'reverse:abc=' -> cba."
    )
    min_value: int = Field(0, ge=0, description="add/mul: smallest operand.")
    max_value: int = Field(9, ge=0, description="add/mul: largest operand.")
    min_length: int = Field(1, ge=1, description="copy/reverse: shortest string.")
    max_length: int = Field(3, ge=1, description="copy/reverse: longest string.")
    alphabet: str = Field(
        "abcdefghij", min_length=1, description="copy/reverse: characters the strings use."
    )

    @model_validator(mode="after")
    def _ranges(self) -> ProceduralSourceConfig:
        if self.max_value < self.min_value:
            raise ValueError("max_value must be >= min_value")
        if self.max_length < self.min_length:
            raise ValueError("max_length must be >= min_length")
        return self


SourceConfig = Annotated[
    ReasoningGymSourceConfig | JsonlSourceConfig | ProceduralSourceConfig,
    Field(discriminator="kind"),
]


class RewardConfig(Section):
    """One reward function of a task and its weight in the task's reward."""

    name: str = Field(
        min_length=1,
        description="A built-in reward (reasoning_gym, math_verify, exact_match, regex_match, "
        "format, char_match, length_penalty), a plug-in named in grader.reward_plugins, or an "
        "import path 'package.module:function'.",
    )
    weight: float = Field(1.0, description="Multiplier of this reward in the task's sum.")
    params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the function on each call."
    )
    label: str | None = Field(
        None,
        description="Name of this component in scores and metrics; defaults to `name` (the "
        "function name for import paths). Needed when one function appears twice.",
    )

    @property
    def component(self) -> str:
        """The key of this reward in ItemScore.components."""
        if self.label:
            return self.label
        return self.name.rsplit(":", 1)[-1]


class SplitConfig(Section):
    """Disjoint parts of a task's prompt space, for evaluation and the supervised warm-start.

    A prompt's part is fixed by a hash of the task name and the prompt text (``u`` in [0, 1)):
    ``u < eval`` is the evaluation part, ``eval <= u < eval + warm_start`` the warm-start part,
    the rest the RL training part. Seeds pick which prompts a stream draws, never which part a
    prompt is in, so the three parts share no prompt text whatever the seeds
    (podrl.tasks.task_stream.part_of).
    """

    eval: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of the task's prompt space held out for evaluation "
        "(loop.eval_prompts); RL and the warm-start never draw these prompts.",
    )
    warm_start: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of the prompt space kept for `podrl warm-start` only; 0 = the "
        "warm-start draws from the RL part with a seed of its own (it may then repeat prompts "
        "of the RL stream when the prompt space is small).",
    )

    @model_validator(mode="after")
    def _leaves_training(self) -> SplitConfig:
        if self.eval + self.warm_start >= 1:
            raise ValueError(
                f"eval ({self.eval:g}) + warm_start ({self.warm_start:g}) must be below 1: "
                "nothing would be left for RL"
            )
        return self


class TaskConfig(Section):
    """One task: its prompt source, prompt template and reward functions."""

    name: str = Field(
        description="Task name; items and ScoreItem.task carry it (letters, digits, _ . -)."
    )
    source: SourceConfig = Field(
        description="Where questions and answers come from; `kind` picks reasoning_gym, jsonl "
        "or procedural."
    )
    template: str = Field(
        "{question}",
        description="Prompt template. Variables: question, task, and the item's metadata fields. "
        "A str.format string, or Jinja when template_format is jinja (write chat markup here "
        "for chat models).",
    )
    template_format: Literal["format", "jinja"] = Field(
        "format", description="format: Python str.format; jinja: a Jinja2 template."
    )
    target_template: str = Field(
        "{answer}",
        description="The ideal completion for a supervised warm-start (str.format with answer "
        "and the item's metadata fields). With environment: the model's side of an episode, "
        "split into turns after each turn_stop string; the warm-start plays it against the "
        "environment and trains it with the replies masked.",
    )
    rewards: list[RewardConfig] = Field(
        min_length=1, description="Reward functions; the task's reward is their weighted sum."
    )
    weight: float = Field(1.0, gt=0, description="Share of prompts drawn from this task.")
    seed: int | None = Field(
        None, description="Seed of this task's stream; None derives it from tasks.seed and name."
    )
    fallback_reward: float | None = Field(
        None, description="Reward of an item whose scoring failed; None uses grader's."
    )
    split: SplitConfig = Field(
        default_factory=SplitConfig,
        description="Held-out parts of the prompt space: evaluation and warm-start.",
    )
    eval_source: SourceConfig | None = Field(
        None,
        description="A source of evaluation prompts of its own (e.g. a test-set JSONL) instead "
        "of split.eval; podrl does not check it against the RL stream.",
    )
    environment: str | None = Field(
        None,
        min_length=1,
        description="An environment (a built-in or an environments.plugins name) that plays "
        "each sample as a multi-turn episode: the controller's episode runner calls it, and its "
        "reward replaces the task's rewards in training. None: single-turn, scored by rewards.",
    )
    turn_stop: list[str] = Field(
        default_factory=list,
        description="With environment: strings that end a turn and stay in its text (a tool "
        "call's closing tag, e.g. '</calc>'), beside loop.sampling.stop.",
    )
    pass_threshold: float = Field(
        1.0,
        description="An evaluation prompt counts as passed (held-out accuracy) when its greedy "
        "completion's reward is at least this.",
    )

    @property
    def has_eval(self) -> bool:
        """Whether the task has evaluation prompts (split.eval or eval_source)."""
        return self.eval_source is not None or self.split.eval > 0

    @field_validator("name")
    @classmethod
    def _name_shape(cls, name: str) -> str:
        if not _TASK_NAME.match(name):
            raise ValueError(f"task name {name!r} must match {_TASK_NAME.pattern}")
        return name

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.template_format == "format":
            _check_format_string(self.template, "template")
        _check_format_string(self.target_template, "target_template")
        if self.eval_source is not None and self.split.eval > 0:
            raise ValueError(
                "set either split.eval (a held-out part of the source) or eval_source (a source "
                "of its own), not both"
            )
        labels = [reward.component for reward in self.rewards]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(
                f"rewards: components {duplicates} appear twice; give them distinct `label`s"
            )
        return self


def _check_format_string(template: str, field: str) -> None:
    try:
        list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"{field} is not a valid str.format template: {err}") from None


def _default_tasks() -> list[TaskConfig]:
    # Single-digit sums from reasoning-gym: small enough for the tiny CPU model, scored by
    # reasoning-gym's own scorer on the whole completion.
    return [
        TaskConfig(
            name="basic_arithmetic",
            source=ReasoningGymSourceConfig(
                dataset="basic_arithmetic",
                params={
                    "min_terms": 2,
                    "max_terms": 2,
                    "min_digits": 1,
                    "max_digits": 1,
                    "operators": ["+"],
                    "allow_parentheses": False,
                    "allow_negation": False,
                },
            ),
            template="{question} Answer with the number only.\n",
            rewards=[RewardConfig(name="reasoning_gym", params={"answer_tag": None})],
        )
    ]


class TasksConfig(Section):
    """The tasks of the run; prompts are drawn from them by weight."""

    seed: int = Field(0, description="Seed of the prompt stream (each task derives its own).")
    definitions: list[TaskConfig] = Field(
        default_factory=_default_tasks, min_length=1, description="The tasks (at least one)."
    )

    @model_validator(mode="after")
    def _unique_names(self) -> TasksConfig:
        names = [task.name for task in self.definitions]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"definitions: task names {duplicates} appear twice")
        return self

    def by_name(self) -> dict[str, TaskConfig]:
        return {task.name: task for task in self.definitions}
