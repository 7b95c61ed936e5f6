"""Supervised warm-start: teach the initial policy the task's answer format before RL.

A random-init tiny model has never seen a newline after an answer, so almost every sample runs
to ``max_tokens`` and RL has little signal to start from. A few steps of next-token training on
``prompt + target`` items of the task source fix the format; what remains to learn is left to
RL. ``podrl warm-start`` runs it and writes a Hugging Face folder the run's trainer and
generator then load.

What the warm-start sees: the **warm-start part** of each task's prompt space
(``tasks.definitions[i].split.warm_start``). The parts are fixed by a hash of the prompt text
(``podrl.tasks.task_stream.part_of``), so the warm-start shares no prompt with the RL stream (the
training part) or the evaluation prompts (the eval part), whatever the seeds. A task without a
warm-start part lends it its training part, drawn by a stream of its own (:func:`warm_start_tasks`:
every task reseeded from its run seed, whether the task sets ``seed`` itself or derives it from
``tasks.seed``); over a small prompt space (e.g. 155 copy prompts) such a stream still draws prompt
texts of the RL stream, so give every task a ``split.warm_start`` to keep them apart.

A task that names an environment is trained as RL plays it (:class:`EpisodeTargets`): its
target is the model's side of an episode, played turn by turn against the environment, whose
replies are in the sequence with loss mask 0, so the warm-start never trains the model to write
what the tool answers.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from podrl.config import ConfigError, RunConfig
from podrl.config.tasks import TaskConfig, TasksConfig
from podrl.environments.isolation import (
    EnvironmentSpec,
    Limits,
    reset_episode,
    resolve_environments,
    step_episode,
)
from podrl.tasks import PromptItem, TaskMixture, build_task_source
from podrl.tasks.factory import task_seed
from podrl.tasks.task_stream import derive_seed
from podrl.trainer.parallel import wants_cuda


@dataclass(frozen=True)
class WarmStartResult:
    out_dir: Path
    losses: list[float]


def warm_start_tasks(tasks: TasksConfig, seed: int) -> TasksConfig:
    """``tasks`` with every stream reseeded for the warm-start: each task's seed is derived
    from the seed the RL run uses for it (its own ``seed`` or the derived one) and ``seed``."""
    definitions = [
        task.model_copy(
            update={"seed": derive_seed(task_seed(tasks, task), f"warm-start:{seed}:{task.name}")}
        )
        for task in tasks.definitions
    ]
    return tasks.model_copy(update={"seed": tasks.seed + seed, "definitions": definitions})


def warm_start_source(tasks: TasksConfig, seed: int) -> TaskMixture:
    """The prompts the warm-start trains on: the warm-start part of each task (its training
    part if it has none), drawn by reseeded streams (:func:`warm_start_tasks`)."""
    return build_task_source(warm_start_tasks(tasks, seed), part="warm_start")


@dataclass(frozen=True)
class TargetTokens:
    """One supervised sequence: the prompt (never trained) and the completion with its mask
    (1 trained, 0 an environment's reply)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    mask: list[int]


def split_turns(target: str, turn_stop: list[str]) -> list[str]:
    """``target`` cut after each occurrence of a ``turn_stop`` string (kept in its turn), as a
    generator stopping at those strings would end each turn; the rest is the last turn."""
    turns: list[str] = []
    rest = target
    while rest:
        ends = [rest.find(stop) + len(stop) for stop in turn_stop if stop and stop in rest]
        end = min(ends) if ends else len(rest)
        turns.append(rest[:end])
        rest = rest[end:]
    return turns


class EpisodeTargets:
    """The warm-start's sequences: ``prompt + target`` for a single-turn task; for a task naming
    an environment, the target's turns (:func:`split_turns`) played against that environment
    in this process (reset with the item, one step per turn), each reply tokenized on its own
    and masked, as the episode runner builds an episode. A target the environment ends before
    its last turn is refused naming ``target_template``."""

    def __init__(self, config: RunConfig, tokenizer: object) -> None:
        self._tokenizer = tokenizer
        self._tasks = {
            task.name: (index, task) for index, task in enumerate(config.tasks.definitions)
        }
        episodic = any(task.environment for task in config.tasks.definitions)
        self._specs: dict[str, EnvironmentSpec] = (
            resolve_environments(config.environments) if episodic else {}
        )
        env = config.environments
        self._limits = Limits(env.max_tool_output_chars, env.max_state_bytes)

    def _ids(self, text: str) -> list[int]:
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    def tokens(self, item: PromptItem, seed: int) -> TargetTokens:
        index, task = self._tasks[item.task]
        if task.environment is None:
            target = self._ids(item.target)
            return TargetTokens(self._ids(item.prompt), target, [1] * len(target))
        return self._episode(item, index, task, seed)

    def _episode(self, item: PromptItem, index: int, task: TaskConfig, seed: int) -> TargetTokens:
        field = f"tasks.definitions[{index}].target_template"
        spec = self._specs[task.environment or ""]
        start = reset_episode(spec, item.prompt, item.reference, item.metadata, seed, self._limits)
        turns = split_turns(item.target, task.turn_stop)
        completion: list[int] = []
        mask: list[int] = []
        state = start.state
        for number, turn in enumerate(turns, start=1):
            ids = self._ids(turn)
            completion += ids
            mask += [1] * len(ids)
            reply = step_episode(state, turn, self._limits)
            state = reply.state
            if reply.done:
                if number < len(turns):
                    raise ConfigError(
                        f"{field}: environment {task.environment!r} ended the episode of "
                        f"{item.prompt!r} after turn {number} of the target's {len(turns)} "
                        f"({turns!r}); write a target whose turns end at the task's turn_stop "
                        f"{task.turn_stop!r} and whose last turn ends the episode"
                    )
                break
            if reply.observation:
                ids = self._ids(reply.observation)
                completion += ids
                mask += [0] * len(ids)
        return TargetTokens(self._ids(item.prompt + start.observation), completion, mask)


def warm_start(
    config: RunConfig,
    model_dir: Path,
    out_dir: Path,
    *,
    steps: int,
    batch_size: int = 32,
    lr: float = 5e-4,
    seed: int = 1234,
    on_step: Callable[[int, float], None] | None = None,
) -> WarmStartResult:
    """Train ``steps`` supervised steps on task targets; save the model to ``out_dir``.
    ``on_step(step, loss)`` is called after each step (1-based), e.g. for a progress bar."""
    torch.manual_seed(seed)
    source = warm_start_source(config.tasks, seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    # On the run's accelerator when it has one (a 0.6B-shaped model on a GPU machine's CPU
    # takes seconds a step); the CPU keeps torch's own thread count.
    device = torch.device("cuda" if wants_cuda(config) else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    targets = EpisodeTargets(config, tokenizer)
    losses = []
    for step in range(steps):
        items = source.next_prompts(batch_size)
        rows = [targets.tokens(item, seed + step * batch_size + i) for i, item in enumerate(items)]
        length = max(len(r.prompt_ids) + len(r.completion_ids) for r in rows)
        input_ids = torch.full((len(items), length), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)  # only trained target tokens have labels
        for row, r in enumerate(rows):
            start, end = len(r.prompt_ids), len(r.prompt_ids) + len(r.completion_ids)
            input_ids[row, :end] = torch.tensor(r.prompt_ids + r.completion_ids)
            labels[row, start:end] = torch.tensor(
                [t if m else -100 for t, m in zip(r.completion_ids, r.mask, strict=True)]
            )
        loss = model(input_ids=input_ids.to(device), labels=labels.to(device)).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(len(losses), losses[-1])
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in model_dir.iterdir():  # tokenizer, chat template, generation config
        if name.is_file() and not name.name.endswith(".safetensors") and name.name != "config.json":
            shutil.copy2(name, out_dir / name.name)
    return WarmStartResult(out_dir, losses)
