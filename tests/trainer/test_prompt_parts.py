"""The warm-start data, the RL stream and the evaluation prompts share no prompt, with and
without per-task seeds: all three sets are built the way the warm-start, the controller and the
evaluation build them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from podrl.config import ConfigError, RunConfig, load_config
from podrl.controller.records.evaluation import Evaluator
from podrl.tasks import build_task_source
from podrl.tasks.task_stream import part_of
from podrl.trainer.warm_start import warm_start_source

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.yaml"
MAKEFILE = (REPO / "Makefile").read_text()


def _prompt_sets(config: RunConfig, rl_draws: int, warm_draws: int) -> dict[str, set[str]]:
    """The RL stream (what the controller's loop draws), the warm-start's data (its batches of
    32) and the evaluation set (what the controller's Evaluator asks)."""
    return {
        "rl": {i.prompt for i in build_task_source(config.tasks).next_prompts(rl_draws)},
        "warm": {i.prompt for i in warm_start_source(config.tasks, 1234).next_prompts(warm_draws)},
        "eval": {i.prompt for i in Evaluator(config).items},
    }


def _with_task_seeds(config: RunConfig, seed: int | None) -> RunConfig:
    data = config.model_dump(mode="json")
    for task in data["tasks"]["definitions"]:
        task["seed"] = seed
    return RunConfig.model_validate(data)


@pytest.mark.parametrize("task_seed", [None, 17], ids=["derived-seeds", "per-task-seed"])
def test_the_demos_warm_start_rl_and_evaluation_prompts_are_disjoint(
    task_seed: int | None,
) -> None:
    config = _with_task_seeds(load_config(DEMO, env={}), task_seed)
    steps, per_step = config.loop.steps, config.loop.prompts_per_step
    # Everything the demo draws: every RL step's prompts, `make demo`'s warm-start steps.
    warm_steps = int(re.search(r"^WARM_START_STEPS \?= (\d+)$", MAKEFILE, re.M).group(1))
    sets = _prompt_sets(config, steps * per_step, warm_steps * 32)
    assert len(sets["eval"]) == config.loop.eval_prompts  # distinct questions
    assert sets["rl"].isdisjoint(sets["warm"])
    assert sets["rl"].isdisjoint(sets["eval"])
    assert sets["warm"].isdisjoint(sets["eval"])
    # Real streams: each draws many distinct prompts of its part.
    assert len(sets["rl"]) > 100 and len(sets["warm"]) > 100


def _copy_task(**extra: Any) -> dict[str, Any]:
    return {
        "name": "copy",
        "source": {"kind": "procedural", "generator": "copy", "max_length": 2, "alphabet": "abcd"},
        "target_template": "{answer}\n",
        "rewards": [{"name": "exact_match"}],
        **extra,
    }


@pytest.mark.parametrize("task_seed", [None, 3])
def test_a_small_space_is_split_whole_and_each_stream_keeps_to_its_part(
    task_seed: int | None,
) -> None:
    """20 prompts in all: the streams go round their parts many times and still never cross."""
    task = _copy_task(split={"eval": 0.25, "warm_start": 0.25}, seed=task_seed)
    config = RunConfig.model_validate(
        {"loop": {"eval_prompts": 3}, "tasks": {"definitions": [task]}}
    )
    sets = _prompt_sets(config, 400, 400)
    split = config.tasks.definitions[0].split
    for part, prompts in (
        ("train", sets["rl"]),
        ("warm_start", sets["warm"]),
        ("eval", sets["eval"]),
    ):
        assert {part_of("copy", p, split) for p in prompts} == {part}
    assert len(sets["rl"] | sets["warm"] | sets["eval"]) <= 4 + 16


def test_the_part_of_a_prompt_does_not_depend_on_seeds() -> None:
    split = (
        RunConfig.model_validate({"tasks": {"definitions": [_copy_task(split={"eval": 0.3})]}})
        .tasks.definitions[0]
        .split
    )
    prompts = {}
    for seed in (0, 1, 99):
        config = RunConfig.model_validate(
            {"tasks": {"seed": seed, "definitions": [_copy_task(split={"eval": 0.3})]}}
        )
        prompts[seed] = build_task_source(config.tasks).next_prompts(50)
    everything = [item.prompt for items in prompts.values() for item in items]
    assert all(part_of("copy", p, split) == "train" for p in everything)
    assert [i.prompt for i in prompts[0]] != [i.prompt for i in prompts[1]]  # seeds do matter


def test_no_split_leaves_the_rl_stream_as_it_was() -> None:
    """A config without split draws exactly the stream it drew before parts existed (the item
    ids are record indices: 0, 1, 2, ... with nothing skipped)."""
    config = RunConfig.model_validate({"tasks": {"definitions": [_copy_task()]}})
    items = build_task_source(config.tasks).next_prompts(30)
    assert [i.id for i in items] == [f"copy/{n}" for n in range(30)]


def test_a_part_the_space_cannot_fill_is_a_config_error_naming_the_field() -> None:
    # One prompt in the whole space ("copy:a="): one of the two parts is empty.
    task = _copy_task(
        source={"kind": "procedural", "generator": "copy", "max_length": 1, "alphabet": "a"},
        split={"eval": 0.5},
    )
    config = RunConfig.model_validate({"tasks": {"definitions": [task]}})
    with pytest.raises(ValueError, match=r"tasks\.definitions\[0\]\.split: .* too small"):
        build_task_source(config.tasks).next_prompts(1)
        build_task_source(config.tasks, part="eval").next_prompts(1)


def test_an_eval_source_of_its_own_feeds_the_evaluation(tmp_path: Path) -> None:
    data = tmp_path / "test.jsonl"
    data.write_text(
        '{"question": "copy:zz=", "answer": "zz"}\n{"question": "copy:yy=", "answer": "yy"}\n'
    )
    task = _copy_task(eval_source={"kind": "jsonl", "path": str(data), "shuffle": False})
    config = RunConfig.model_validate(
        {"loop": {"eval_prompts": 2}, "tasks": {"definitions": [task]}}
    )
    items = Evaluator(config).items
    assert [(i.id, i.prompt, i.reference) for i in items] == [
        ("copy/eval/0", "copy:zz=", "zz"),
        ("copy/eval/1", "copy:yy=", "yy"),
    ]


def test_no_task_with_evaluation_prompts_names_the_fix() -> None:
    config = RunConfig.model_validate({"tasks": {"definitions": [_copy_task()]}})
    with pytest.raises(ConfigError, match=r"split: \{eval: 0\.1\}.* eval_source"):
        build_task_source(config.tasks, part="eval")


def test_split_and_eval_source_together_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    task = _copy_task(split={"eval": 0.1}, eval_source={"kind": "jsonl", "path": "x.jsonl"})
    path.write_text(yaml.safe_dump({"tasks": {"definitions": [task]}}))
    with pytest.raises(ConfigError, match=r"either split\.eval .* or eval_source"):
        load_config(path, env={})
