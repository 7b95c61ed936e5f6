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
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from podrl.config import RunConfig
from podrl.config.tasks import TasksConfig
from podrl.tasks import TaskMixture, build_task_source
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
    losses = []
    for _ in range(steps):
        items = source.next_prompts(batch_size)
        prompts = [tokenizer(item.prompt, add_special_tokens=False)["input_ids"] for item in items]
        targets = [tokenizer(item.target, add_special_tokens=False)["input_ids"] for item in items]
        length = max(len(p) + len(t) for p, t in zip(prompts, targets, strict=True))
        input_ids = torch.full((len(items), length), tokenizer.pad_token_id, dtype=torch.long)
        labels = torch.full_like(input_ids, -100)  # only target tokens are trained on
        for row, (p, t) in enumerate(zip(prompts, targets, strict=True)):
            input_ids[row, : len(p) + len(t)] = torch.tensor(p + t)
            labels[row, len(p) : len(p) + len(t)] = torch.tensor(t)
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
