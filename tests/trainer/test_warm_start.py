"""The warm-start's prompt stream is not the RL run's, whether tasks set their own ``seed``
(which wins over ``tasks.seed``) or derive it."""

from __future__ import annotations

import pytest
import yaml

from podrl.config import load_config
from podrl.tasks import build_task_source
from podrl.trainer.warm_start import warm_start_tasks

DRAWS = 400


def _tasks(tmp_path, task_seed: int | None):
    task = {
        "name": "copy",
        # 10^6 + 10^7 + 10^8 strings: independent streams of 400 draws share none.
        "source": {
            "kind": "procedural",
            "generator": "copy",
            "min_length": 6,
            "max_length": 8,
            "alphabet": "abcdefghij",
        },
        "template": "{question}",
        "rewards": [{"name": "exact_match"}],
    }
    if task_seed is not None:
        task["seed"] = task_seed
    other = {**task, "name": "copy-2"}
    other.pop("seed", None)  # a second task that derives its seed from tasks.seed
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"tasks": {"seed": 5, "definitions": [task, other]}}))
    return load_config(path, env={}).tasks


def _prompts(tasks) -> list[str]:
    return [item.prompt for item in build_task_source(tasks).next_prompts(DRAWS)]


@pytest.mark.parametrize("task_seed", [None, 17], ids=["derived-seeds", "per-task-seed"])
def test_the_warm_start_shares_no_prompt_with_the_rl_stream(tmp_path, task_seed):
    tasks = _tasks(tmp_path, task_seed)
    rl = _prompts(tasks)
    warm = _prompts(warm_start_tasks(tasks, 1234))
    assert len(set(rl)) > DRAWS * 0.99  # a large space: both are real streams
    assert set(rl).isdisjoint(warm)
    # Deterministic: the same warm-start seed gives the same stream.
    assert _prompts(warm_start_tasks(tasks, 1234)) == warm
