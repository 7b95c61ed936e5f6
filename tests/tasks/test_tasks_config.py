"""The tasks config section: defaults that work, and errors that name the field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from podrl.config import ConfigError, RunConfig, load_config

EXACT = {"name": "exact_match"}


def _task(rewards: list[dict[str, Any]], **source: Any) -> dict[str, Any]:
    return {
        "name": "add",
        "source": {"kind": "procedural", "generator": "add", **source},
        "rewards": rewards,
    }


def _load(definitions: list[dict[str, Any]]) -> RunConfig:
    return load_config(env={"PODRL_TASKS__DEFINITIONS": json.dumps(definitions)})


def test_default_run_config_has_a_reasoning_gym_task() -> None:
    tasks = load_config(env={}).tasks
    assert [t.name for t in tasks.definitions] == ["basic_arithmetic"]
    assert tasks.definitions[0].source.kind == "reasoning_gym"


@pytest.mark.parametrize(
    ("definitions", "message"),
    [
        ([_task([EXACT]), _task([EXACT])], r"tasks: .*definitions: task names \['add'\] appear"),
        ([_task([EXACT, EXACT])], r"tasks\.definitions\.0: .*\['exact_match'\] appear twice"),
        ([_task([])], r"tasks\.definitions\.0\.rewards: List should have at least 1"),
        (
            [_task([EXACT], min_value=5, max_value=1)],
            r"tasks\.definitions\.0\.source\.procedural: .*max_value must be >= min_value",
        ),
        (
            [{"name": "x", "source": {"kind": "csv"}, "rewards": [EXACT]}],
            r"tasks\.definitions\.0\.source: .*'reasoning_gym', 'jsonl', 'procedural'",
        ),
        (
            [{**_task([EXACT]), "template": "{question"}],
            r"tasks\.definitions\.0: .*template is not a valid str\.format template",
        ),
    ],
)
def test_bad_tasks_config_names_the_field(definitions: list[dict[str, Any]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _load(definitions)


def test_two_uses_of_one_reward_with_labels_are_fine() -> None:
    second = {"name": "exact_match", "label": "exact_ci", "params": {"case_sensitive": False}}
    config = _load([_task([EXACT, second])])
    components = [r.component for r in config.tasks.definitions[0].rewards]
    assert components == ["exact_match", "exact_ci"]
