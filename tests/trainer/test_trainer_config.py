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
        ({"PODRL_TRAINER__TIS_CAP": "-1"}, "trainer.tis_cap"),
        (
            {"PODRL_TRAINER__LR_SCHEDULE": "cosine", "PODRL_TRAINER__WARMUP_STEPS": "2000"},
            "trainer.warmup_steps",
        ),
    ],
)
def test_bad_values_name_the_field(env, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(None, env)
