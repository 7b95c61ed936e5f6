"""The environment overrides one field of a list item, as the hint of a validation error says
(`PODRL_TASKS__DEFINITIONS__0__...`; before, it failed with 'Input should
be a valid list')."""

from __future__ import annotations

from pathlib import Path

import pytest

from podrl.config import ConfigError, load_config

TASKS = """\
tasks:
  definitions:
    - name: add
      source: {kind: procedural, generator: add}
      rewards: [{name: exact_match}]
      fallback_reward: not a number
    - name: copy
      source: {kind: procedural, generator: copy}
      rewards: [{name: exact_match}]
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(TASKS)
    return path


def test_the_hint_of_a_list_item_error_is_an_override_that_works(config_file: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(config_file, env={})
    hint = "PODRL_TASKS__DEFINITIONS__0__FALLBACK_REWARD"
    assert hint in str(err.value)
    config = load_config(config_file, env={hint: "0.25"})
    first, second = config.tasks.definitions
    assert (first.name, first.fallback_reward) == ("add", 0.25)
    assert second.name == "copy"  # the other items are as in the file


def test_nested_list_items_and_a_new_item(config_file: Path) -> None:
    env = {
        "PODRL_TASKS__DEFINITIONS__0__FALLBACK_REWARD": "0",
        "PODRL_TASKS__DEFINITIONS__1__REWARDS__0__WEIGHT": "2.5",
        "PODRL_TASKS__DEFINITIONS__2": '{"name": "third", "source": {"kind": "procedural", '
        '"generator": "add"}, "rewards": [{"name": "exact_match"}]}',
    }
    config = load_config(config_file, env=env)
    assert [t.name for t in config.tasks.definitions] == ["add", "copy", "third"]
    assert config.tasks.definitions[1].rewards[0].weight == 2.5


def test_an_item_past_the_end_is_refused_naming_the_variable(config_file: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(
            config_file,
            env={
                "PODRL_TASKS__DEFINITIONS__0__FALLBACK_REWARD": "0",
                "PODRL_TASKS__DEFINITIONS__5__NAME": "x",
            },
        )
    assert "PODRL_TASKS__DEFINITIONS__5" in str(err.value)
    assert "holds 2 item(s)" in str(err.value)
