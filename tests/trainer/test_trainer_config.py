"""Trainer config: defaults work, bad values name the field."""

from __future__ import annotations

import pytest

from podrl.config import ConfigError, load_config


def test_defaults_are_a_single_cpu_rank():
    trainer = load_config(None, {}).trainer
    assert trainer.world_size == 1 and trainer.loss_mode == "grpo"
    assert trainer.model_path is None  # the tiny model under run_dir


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"PODRL_TRAINER__DP_SHARD": "0"}, "trainer.dp_shard"),
        ({"PODRL_TRAINER__LOSS_MODE": "ppo"}, "trainer.loss_mode"),
        ({"PODRL_TRAINER__CLIP_EPS_LOW": "1.5"}, "trainer.clip_eps_low"),
        ({"PODRL_TRAINER__TIS_CAP": "1.5"}, "trainer.tis_cap: .*trainer.off_policy"),
        ({"PODRL_TRAINER__OFF_POLICY__MASK_LOW": "2"}, "trainer.off_policy.mask_low"),
        ({"PODRL_TRAINER__CLIP_RATIO_C": "1.0"}, "trainer.clip_ratio_c: .*must be > 1"),
        ({"PODRL_TRAINER__CLIP_RATIO_C": "-3"}, "trainer.clip_ratio_c: .*must be > 1"),
        ({"PODRL_TRAINER__CHECKPOINT_KEEP_LATEST": "-1"}, "trainer.checkpoint_keep_latest"),
        (
            {"PODRL_TRAINER__LR_SCHEDULE": "cosine", "PODRL_TRAINER__WARMUP_STEPS": "2000"},
            "trainer.warmup_steps",
        ),
    ],
)
def test_bad_values_name_the_field(env, field):
    with pytest.raises(ConfigError, match=field.replace("trainer.", r"trainer\.")):
        load_config(None, env)


def test_dual_clip_is_on_by_default_and_zero_or_null_turns_it_off(tmp_path):
    assert load_config(None, {}).trainer.clip_ratio_c == 3.0
    (tmp_path / "run.yaml").write_text("trainer:\n  clip_ratio_c: null\n")
    assert load_config(tmp_path / "run.yaml", {}).trainer.clip_ratio_c is None
    assert load_config(None, {"PODRL_TRAINER__CLIP_RATIO_C": "0"}).trainer.clip_ratio_c is None
    assert load_config(None, {"PODRL_TRAINER__CLIP_RATIO_C": "2.5"}).trainer.clip_ratio_c == 2.5
