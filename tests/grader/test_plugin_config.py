"""Reward plug-ins are loaded and checked at start; a bad one is a clear error naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from podrl.config import ConfigError, load_config
from podrl.grader.rewards import build_reward_plans, score_with_plan
from podrl.grader.rewards.scoring import InvalidRewardError, ItemInput
from tests.grader.conftest import grader_config

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.grader.faulty_rewards"


def _task(rewards: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "t", "source": {"kind": "procedural", "generator": "copy"}, "rewards": rewards}


def _plans(rewards: list[dict[str, Any]], **grader: Any):
    config = grader_config([_task(rewards)], **grader)
    return build_reward_plans(config.tasks, config.grader)


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ({"name": "no_such_reward"}, r"rewards\[0\]\.name: unknown reward 'no_such_reward'"),
        (
            {"name": "no_such_package.mod:fn"},
            r"rewards\[0\]\.name: cannot import module 'no_such_package\.mod'",
        ),
        ({"name": f"{MODULE}:missing"}, r"has no attribute 'missing'"),
        ({"name": f"{MODULE}:NOT_A_FUNCTION"}, r"is a int, not a function"),
        ({"name": f"{MODULE}:wrong_signature"}, r"rewards\[0\]: .* has signature \(text"),
        ({"name": f"{MODULE}:needs_extra"}, r"missing a required argument: 'threshold'"),
        (
            {"name": f"{MODULE}:uses_context", "params": {"unknown": 1}},
            r"unexpected keyword argument 'unknown'",
        ),
        (
            {"name": f"{MODULE}:uses_context", "params": {"metadata": {}}},
            r"rewards\[0\]\.params: \['metadata'\] are passed by the grader",
        ),
        ({"name": f"{MODULE}:LAMBDA"}, r"must be a module-level function"),
        ({"name": "regex_match", "params": {"pattern": "("}}, r"params\.pattern: invalid regular"),
        ({"name": "regex_match"}, r"missing a required argument: 'pattern'"),
        ({"name": "exact_match", "params": {"stirp": True}}, r"unexpected keyword argument"),
    ],
)
def test_bad_reward_config_names_the_field(reward: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _plans([reward])
    assert "tasks.definitions[0].rewards[0]" in str(err.value)


def test_bad_plugin_in_grader_section_names_both_fields() -> None:
    with pytest.raises(ConfigError, match=r"grader\.reward_plugins\['mine'\] \(used by tasks"):
        _plans([{"name": "mine"}], reward_plugins={"mine": f"{MODULE}:missing"})
    with pytest.raises(ConfigError, match=r"rewards\[0\] \(via grader\.reward_plugins\['mine'\]\)"):
        _plans([{"name": "mine"}], reward_plugins={"mine": f"{MODULE}:wrong_signature"})


def test_malformed_plugin_path_is_rejected_by_config() -> None:
    with pytest.raises(
        ConfigError, match=r"grader\.reward_plugins.*not 'package\.module:function'"
    ):
        load_config(env={"PODRL_GRADER__REWARD_PLUGINS": '{"mine": "no colon"}'})


def test_plugin_receives_params_and_context() -> None:
    plans = _plans([{"name": f"{MODULE}:uses_context", "params": {"bonus": 0.25}}])
    item = ItemInput(
        prompt="p", completion="x", reference="r", task="t", metadata={"expected": "x"}
    )
    assert score_with_plan(plans["t"], item).reward == pytest.approx(1.25)
    assert plans["t"].components[0].context == ("metadata",)


def test_non_numeric_reward_is_an_error() -> None:
    plans = _plans([{"name": f"{MODULE}:returns_text"}])
    with pytest.raises(InvalidRewardError, match="must return a number"):
        score_with_plan(plans["t"], ItemInput(prompt="", completion="", reference="", task="t"))


def test_grader_process_exits_2_with_the_field_on_a_bad_plugin(tmp_path: Path) -> None:
    config = {
        "tasks": {"definitions": [_task([{"name": f"{MODULE}:wrong_signature"}])]},
        "grader": {"metrics_port": 0},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PODRL_LOG__FORMAT": "text"}
    done = subprocess.run(
        [sys.executable, "-m", "podrl.grader", "--config", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "tasks.definitions[0].rewards[0]" in done.stderr
    assert "wrong_signature" in done.stderr
