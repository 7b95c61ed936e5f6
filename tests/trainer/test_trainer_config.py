"""Trainer config: defaults work, bad values name the field."""

from __future__ import annotations

from datetime import timedelta

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


def test_the_rank_command_loop_waits_as_long_as_configured(monkeypatch):
    # Ranks > 0 wait for rank 0's next command on the loop's own gloo group, whose timeout
    # is the idle timeout: the config's, not a constant.
    import torch.distributed as dist

    from podrl.trainer.servicer import CommandLoop

    groups: list[dict] = []
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist, "new_group", lambda **kwargs: groups.append(kwargs))
    settings = load_config(None, {"PODRL_TRAINER__COMMAND_IDLE_TIMEOUT_SECONDS": "90"}).trainer
    CommandLoop.build(settings)
    assert groups == [{"backend": "gloo", "timeout": timedelta(seconds=90)}]
    assert load_config(None, {}).trainer.command_idle_timeout_seconds == 30 * 24 * 3600


def test_gradients_cross_pods_in_buckets_of_the_configured_size():
    import torch

    from podrl.trainer.replication import gradient_buckets

    replication = load_config(
        None, {"PODRL_TRAINER__REPLICATION__GRADIENT_BUCKET_MIB": "1"}
    ).trainer.replication
    assert load_config(None, {}).trainer.replication.gradient_bucket_mib == 256
    quarter = 1 << 16  # float32 elements in 256 KiB
    grads = [torch.full((quarter,), float(i)) for i in range(6)] + [
        torch.zeros(3, dtype=torch.int64)
    ]
    buckets = gradient_buckets(grads, replication.gradient_bucket_mib << 20)
    # A bucket closes once it holds 1 MiB: four float32 tensors, then the other two; the int64
    # tensor has a bucket of its own dtype.
    assert [len(tensors) for tensors, _ in buckets] == [4, 2, 1]
    assert torch.equal(buckets[1][1], torch.cat([grads[4], grads[5]]))
