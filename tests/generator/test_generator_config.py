"""The generator section's weight-apply fields (no engine)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from podrl.config.generator import GeneratorConfig


def test_weight_apply_modes() -> None:
    assert GeneratorConfig().weight_apply_mode == "auto"
    assert GeneratorConfig(weight_apply_mode="in_place").weight_apply_mode == "in_place"
    assert GeneratorConfig(weight_apply_mode="reload").weight_apply_mode == "reload"
    assert GeneratorConfig(weight_apply_mode="repack").weight_apply_mode == "repack"


def test_the_old_name_direct_says_what_it_is_called_now() -> None:
    with pytest.raises(ValidationError) as err:
        GeneratorConfig(weight_apply_mode="direct")
    assert "weight_apply_mode" in str(err.value)
    assert "set generator.weight_apply_mode: in_place" in str(err.value)


def test_overrun_is_not_negative() -> None:
    assert GeneratorConfig(weight_apply_overrun_seconds=0).weight_apply_overrun_seconds == 0
    with pytest.raises(ValidationError, match="weight_apply_overrun_seconds"):
        GeneratorConfig(weight_apply_overrun_seconds=-1)


def test_copy_streams_default_to_the_copy_plans_and_are_at_least_one() -> None:
    from podrl.weights.receiver import DEFAULT_COPY_STREAMS

    # The config cannot import the plan (the controller imports no torch): the same number.
    assert GeneratorConfig().weight_copy_streams == DEFAULT_COPY_STREAMS
    with pytest.raises(ValidationError, match="weight_copy_streams"):
        GeneratorConfig(weight_copy_streams=0)
