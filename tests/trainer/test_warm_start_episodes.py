"""The warm-start of a task that names an environment trains its target as an episode: the
model's turns supervised, the environment's replies in the sequence with mask 0."""

from __future__ import annotations

import pytest

from podrl.config import ConfigError, RunConfig
from podrl.models.char_tokenizer import build_char_tokenizer
from podrl.tasks import PromptItem
from podrl.trainer.warm_start import EpisodeTargets, split_turns

TASK = {
    "name": "products",
    "source": {"kind": "procedural", "generator": "mul", "min_value": 100, "max_value": 999},
    "target_template": "<calc>{a}*{b}</calc><answer>{answer}</answer>",
    "environment": "calculator",
    "turn_stop": ["</calc>", "</answer>"],
    "rewards": [{"name": "exact_match"}],
}


def _targets(**task: object) -> EpisodeTargets:
    config = RunConfig.model_validate({"tasks": {"definitions": [{**TASK, **task}]}})
    return EpisodeTargets(config, build_char_tokenizer())


def _item(target: str) -> PromptItem:
    return PromptItem("products/warm_start/1", "products", "123*456=", "56088", target)


def test_split_turns_ends_each_turn_at_its_first_stop_string() -> None:
    stops = ["</calc>", "</answer>"]
    assert split_turns("<calc>1*2</calc><answer>2</answer>", stops) == [
        "<calc>1*2</calc>",
        "<answer>2</answer>",
    ]
    assert split_turns("<answer>2</answer> and more", stops) == ["<answer>2</answer>", " and more"]
    assert split_turns("plain", []) == ["plain"]


def test_the_calculators_reply_is_in_the_sequence_and_never_trained() -> None:
    tokenizer = build_char_tokenizer()
    item = _item("<calc>123*456</calc><answer>56088</answer>")
    tokens = _targets().tokens(item, seed=0)
    assert tokenizer.decode(tokens.prompt_ids) == "123*456="
    text = tokenizer.decode(tokens.completion_ids)
    assert text == "<calc>123*456</calc><result>56088</result><answer>56088</answer>"
    trained = "".join(ch for ch, m in zip(text, tokens.mask, strict=True) if m)
    masked = "".join(ch for ch, m in zip(text, tokens.mask, strict=True) if not m)
    assert trained == "<calc>123*456</calc><answer>56088</answer>"
    assert masked == "<result>56088</result>"  # the tool's reply, as the episode runner masks it


def test_a_single_turn_task_trains_its_whole_target() -> None:
    config = RunConfig.model_validate(
        {"tasks": {"definitions": [{**TASK, "environment": None, "turn_stop": []}]}}
    )
    tokens = EpisodeTargets(config, build_char_tokenizer()).tokens(_item("<answer>7</answer>"), 0)
    assert len(tokens.completion_ids) == len("<answer>7</answer>") and set(tokens.mask) == {1}


def test_a_target_the_environment_ends_early_is_refused_naming_the_field() -> None:
    # The answer comes first: the calculator ends the episode on it, a turn before the call.
    item = _item("<answer>56088</answer><calc>123*456</calc>")
    with pytest.raises(ConfigError, match=r"tasks\.definitions\[0\]\.target_template: .*turn 1"):
        _targets().tokens(item, seed=0)
