"""Knobs of different sections are derived or refused once, at load (podrl.config.coupling).

One test per rule of docs/config.md, each with the accepted (or derived) case and the refused
case; a refusal must name both fields.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from podrl.config import ConfigError, load_config
from podrl.config.run_config import RunConfig
from podrl.config.tasks import TaskConfig
from podrl.tasks.prompt_bounds import PROMPT_SPECIAL_TOKENS, check_prompts_fit, max_prompt_tokens

REPO = Path(__file__).resolve().parents[2]

COPY_TASK: dict[str, Any] = {
    "name": "copy",
    "source": {"kind": "procedural", "generator": "copy", "max_length": 3, "alphabet": "abc"},
    "template": "{question}",
    "rewards": [{"name": "exact_match"}],
}


def _load(tmp_path: Path, data: dict[str, Any]) -> RunConfig:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(path, env={})


def _refused(tmp_path: Path, data: dict[str, Any], *fields: str) -> str:
    """Load ``data``, expect a ConfigError, and check it names every one of ``fields``."""
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, data)
    message = str(err.value)
    for field in fields:
        assert field in message, (field, message)
    return message


def _sampling(**values: Any) -> dict[str, Any]:
    return {"loop": {"sampling": values}}


def test_every_example_config_loads() -> None:
    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples
    for path in examples:
        load_config(path, env={})


def test_greedy_sampling_is_refused(tmp_path: Path) -> None:
    assert _load(tmp_path, _sampling(temperature=1.0)).loop.sampling.temperature == 1.0
    _refused(tmp_path, _sampling(temperature=0.0), "loop.sampling.temperature", "loop.sampling.n")


def test_top_p_and_top_k_truncation_is_refused(tmp_path: Path) -> None:
    for disabled in (0, -1):
        assert _load(tmp_path, _sampling(top_p=1.0, top_k=disabled)).loop.sampling.top_k == disabled
    _refused(tmp_path, _sampling(top_p=0.9), "loop.sampling.top_p", "trainer.logit_temperature")
    _refused(tmp_path, _sampling(top_k=20), "loop.sampling.top_k", "trainer.logit_temperature")


def test_a_sampling_temperature_makes_the_generator_report_tempered_logprobs(
    tmp_path: Path,
) -> None:
    default = _load(tmp_path, {})
    assert default.generator.logprobs_mode == "raw_logprobs"
    assert default.trainer.logit_temperature == 1.0
    tempered = _load(tmp_path, _sampling(temperature=0.7))
    assert tempered.generator.logprobs_mode == "processed_logprobs"
    assert tempered.trainer.logit_temperature == 0.7
    _refused(
        tmp_path,
        {**_sampling(temperature=0.7), "generator": {"logprobs_mode": "raw_logprobs"}},
        "generator.logprobs_mode",
        "loop.sampling.temperature",
    )


def test_the_trainer_logit_temperature_matches_the_reported_logprobs(tmp_path: Path) -> None:
    same = {**_sampling(temperature=0.7), "trainer": {"logit_temperature": 0.7}}
    assert _load(tmp_path, same).trainer.logit_temperature == 0.7
    processed = {"generator": {"logprobs_mode": "processed_logprobs"}}
    assert _load(tmp_path, processed).trainer.logit_temperature == 1.0
    _refused(
        tmp_path,
        {**_sampling(temperature=0.7), "trainer": {"logit_temperature": 1.0}},
        "trainer.logit_temperature",
        "loop.sampling.temperature",
    )
    # Raw logprobs are untempered: a trainer dividing logits by 2 compares other distributions.
    _refused(
        tmp_path,
        {"trainer": {"logit_temperature": 2.0}},
        "trainer.logit_temperature",
        "loop.sampling.temperature",
    )


def test_dr_grpo_max_tokens_follows_the_generation_budget(tmp_path: Path) -> None:
    assert _load(tmp_path, _sampling(max_tokens=48)).trainer.dr_grpo_max_tokens == 48
    dr_grpo = {"trainer": {"loss_mode": "dr_grpo", "dr_grpo_max_tokens": 48}}
    assert _load(tmp_path, {**dr_grpo, **_sampling(max_tokens=48)}).trainer.dr_grpo_max_tokens == 48
    # Unused by the other losses: a stale value there is harmless and kept.
    grpo = {"trainer": {"loss_mode": "grpo", "dr_grpo_max_tokens": 1024}}
    assert _load(tmp_path, {**grpo, **_sampling(max_tokens=48)}).trainer.dr_grpo_max_tokens == 1024
    _refused(
        tmp_path,
        {
            "trainer": {"loss_mode": "dr_grpo", "dr_grpo_max_tokens": 1024},
            **_sampling(max_tokens=48),
        },
        "trainer.dr_grpo_max_tokens",
        "loop.sampling.max_tokens",
    )


def test_dr_grpo_does_not_normalise_advantages_by_std(tmp_path: Path) -> None:
    assert _load(tmp_path, {}).loop.normalize_advantages_std is True
    dr_grpo = {"trainer": {"loss_mode": "dr_grpo"}}
    assert _load(tmp_path, dr_grpo).loop.normalize_advantages_std is False
    explicit = {**dr_grpo, "loop": {"normalize_advantages_std": False}}
    assert _load(tmp_path, explicit).loop.normalize_advantages_std is False
    _refused(
        tmp_path,
        {**dr_grpo, "loop": {"normalize_advantages_std": True}},
        "trainer.loss_mode",
        "loop.normalize_advantages_std",
    )


def test_a_decaying_schedule_spans_the_run(tmp_path: Path) -> None:
    cosine = {"lr_schedule": "cosine", "warmup_steps": 10}
    assert _load(tmp_path, {"trainer": cosine, "loop": {"steps": 200}}).trainer.total_steps == 200
    explicit = {"trainer": {**cosine, "total_steps": 200}, "loop": {"steps": 200}}
    assert _load(tmp_path, explicit).trainer.total_steps == 200
    # Without a loop (steps 0) there is nothing to follow: the trainer's own default stays.
    assert _load(tmp_path, {"trainer": cosine}).trainer.total_steps == 1000
    # The constant schedule never reads total_steps.
    constant = {"trainer": {"total_steps": 1000}, "loop": {"steps": 200}}
    assert _load(tmp_path, constant).trainer.total_steps == 1000
    _refused(
        tmp_path,
        {"trainer": {**cosine, "total_steps": 1000}, "loop": {"steps": 200}},
        "trainer.total_steps",
        "loop.steps",
    )
    _refused(
        tmp_path,
        {"trainer": {**cosine, "warmup_steps": 300}, "loop": {"steps": 200}},
        "trainer.warmup_steps",
        "loop.steps",
    )
    # A long warmup is fine when the run is longer still: total_steps follows loop.steps,
    # not the trainer's default of 1000.
    long_run = {"trainer": {**cosine, "warmup_steps": 1500}, "loop": {"steps": 5000}}
    assert _load(tmp_path, long_run).trainer.total_steps == 5000
    # Without a loop the default total_steps stays, and warmup must end before it.
    _refused(
        tmp_path,
        {"trainer": {**cosine, "warmup_steps": 1500}},
        "trainer.warmup_steps",
        "trainer.total_steps",
    )


def test_a_completion_budget_leaves_room_for_a_prompt(tmp_path: Path) -> None:
    assert _load(tmp_path, _sampling(max_tokens=1023)).loop.sampling.max_tokens == 1023
    _refused(
        tmp_path, _sampling(max_tokens=1024), "loop.sampling.max_tokens", "generator.max_model_len"
    )


def test_loading_a_config_renders_no_prompt(tmp_path: Path) -> None:
    # A prompt too long for the model length is the controller's start check, not load's: the
    # config loads, and the check at start refuses it naming both fields and the task.
    budget = 16 - 9 - PROMPT_SPECIAL_TOKENS
    tight = {"tasks": {"definitions": [COPY_TASK]}, "generator": {"max_model_len": 16}}
    config = _load(tmp_path, {**tight, **_sampling(max_tokens=budget + 1)})
    with pytest.raises(ConfigError) as err:
        check_prompts_fit(config)
    for words in ("loop.sampling.max_tokens", "generator.max_model_len", "'copy'"):
        assert words in str(err.value)


def test_prompt_and_completion_fit_in_the_model_length(tmp_path: Path) -> None:
    # "copy:abc=" is 9 bytes: 9 + PROMPT_SPECIAL_TOKENS + max_tokens must be <= max_model_len.
    budget = 16 - 9 - PROMPT_SPECIAL_TOKENS
    fits = {"tasks": {"definitions": [COPY_TASK]}, "generator": {"max_model_len": 16}}
    check_prompts_fit(_load(tmp_path, {**fits, **_sampling(max_tokens=budget)}))
    with pytest.raises(ConfigError, match=r"generator\.max_model_len"):
        check_prompts_fit(_load(tmp_path, {**fits, **_sampling(max_tokens=budget + 1)}))
    # Prompts of the default reasoning-gym task are unknown before they are drawn.
    check_prompts_fit(_load(tmp_path, _sampling(max_tokens=1023)))


def test_the_prompt_bound_covers_every_prompt_the_task_draws() -> None:
    from podrl.models.char_tokenizer import build_char_tokenizer
    from podrl.tasks.factory import build_records
    from podrl.tasks.task_stream import TaskStream

    tokenizer = build_char_tokenizer()
    for source, template in (
        ({"kind": "procedural", "generator": "add", "max_value": 999}, "{question}"),
        ({"kind": "procedural", "generator": "reverse", "max_length": 5}, "Reverse {text}: "),
    ):
        task = TaskConfig.model_validate(
            {**COPY_TASK, "source": source, "template": template, "name": "t"}
        )
        bound = max_prompt_tokens(task)
        assert bound is not None
        stream = TaskStream(task, build_records(task, 0, "t"), "t")
        prompts = [stream.item(i).prompt for i in range(300)]
        tokens = max(len(tokenizer(prompt)["input_ids"]) for prompt in prompts)
        # The bound is the longest prompt's bytes plus the allowance for special tokens.
        assert bound == max(len(p.encode()) for p in prompts) + PROMPT_SPECIAL_TOKENS
        assert tokens <= bound
    wide = TaskConfig.model_validate(
        {**COPY_TASK, "source": {**COPY_TASK["source"], "alphabet": "aé"}}
    )
    assert max_prompt_tokens(wide) == len("copy:ééé=".encode()) + PROMPT_SPECIAL_TOKENS
    unknown = TaskConfig.model_validate(
        {**COPY_TASK, "source": {"kind": "jsonl", "path": "missing.jsonl"}}
    )
    assert max_prompt_tokens(unknown) is None


def test_every_refusal_of_a_config_is_reported_at_once(tmp_path: Path) -> None:
    data = {
        "trainer": {"loss_mode": "dr_grpo"},
        "loop": {"normalize_advantages_std": True, "sampling": {"max_tokens": 16}},
        "generator": {"max_model_len": 16},
    }
    _refused(tmp_path, data, "loop.normalize_advantages_std", "generator.max_model_len")


def test_sleeping_generators_need_sleep_mode_on_cuda(tmp_path: Path) -> None:
    sleep = {"loop": {"generator_memory": "sleep_during_train"}}
    config = _load(tmp_path, {"device": "cuda", **sleep})
    assert config.generator.enable_sleep_mode is True  # derived
    assert _load(tmp_path, {"device": "cuda"}).generator.enable_sleep_mode is False
    _refused(
        tmp_path,
        {"device": "cuda", "generator": {"enable_sleep_mode": False}, **sleep},
        "loop.generator_memory",
        "generator.enable_sleep_mode",
    )
    _refused(tmp_path, {"device": "cpu", **sleep}, "loop.generator_memory", "device")
    _refused(
        tmp_path,
        {"device": "cuda", "loop": {"generator_memory": "sleep_during_train", "mode": "async"}},
        "loop.generator_memory",
        "loop.mode",
    )


def test_nccl_across_pods_needs_cuda(tmp_path: Path) -> None:
    nccl = {"trainer": {"replication": {"backend": "nccl"}}}
    assert _load(tmp_path, {"device": "cuda", **nccl}).trainer.replication.backend == "nccl"
    gloo = {"trainer": {"replication": {"backend": "gloo"}}}
    assert _load(tmp_path, {"device": "cpu", **gloo}).trainer.replication.backend == "gloo"
    _refused(tmp_path, {"device": "cpu", **nccl}, "trainer.replication.backend", "device")


def test_a_step_fits_in_one_generate(tmp_path: Path) -> None:
    fits = {"loop": {"prompts_per_step": 64, "sampling": {"n": 16}}}
    assert _load(tmp_path, fits).generator.max_samples_per_request == 65536
    _refused(
        tmp_path,
        {**fits, "generator": {"max_samples_per_request": 512}},
        "loop.prompts_per_step",
        "generator.max_samples_per_request",
        "1024 completions",
    )


def test_async_mode_trains_with_the_decoupled_objective_and_token_mask(tmp_path: Path) -> None:
    sync = _load(tmp_path, {}).trainer.off_policy
    assert (sync.correction, sync.mask) == ("none", "none")  # sync runs are unchanged
    async_ = _load(tmp_path, {"loop": {"mode": "async"}}).trainer.off_policy
    assert (async_.correction, async_.mask) == ("truncate", "token")
    chosen = _load(
        tmp_path,
        {"loop": {"mode": "async"}, "trainer": {"off_policy": {"correction": "none"}}},
    ).trainer.off_policy
    assert (chosen.correction, chosen.mask) == ("none", "token")  # a set field is kept
    sequence = _load(
        tmp_path,
        {"loop": {"mode": "async"}, "trainer": {"off_policy": {"mask": "sequence"}}},
    ).trainer.off_policy
    assert (sequence.correction, sequence.mask) == ("truncate", "sequence")


def test_an_episode_fits_in_the_model_length(tmp_path: Path) -> None:
    model = {"generator": {"max_model_len": 2048}}
    assert _load(tmp_path, model).environments.max_episode_tokens == 2048
    kept = _load(tmp_path, {**model, "environments": {"max_episode_tokens": 900}})
    assert kept.environments.max_episode_tokens == 900
    message = _refused(
        tmp_path,
        {"generator": {"max_model_len": 512}, "environments": {"max_episode_tokens": 600}},
        "environments.max_episode_tokens",
        "generator.max_model_len",
    )
    assert "(600)" in message and "(512)" in message
