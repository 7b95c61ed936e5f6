"""loop.mode and loop.max_staleness are validated when the config loads: a bad value stops the
process with a message that names the field and the fix (docs/config.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from podrl.config import ConfigError, RunConfig, load_config


def _load(tmp_path: Path, loop: str, env: dict[str, str] | None = None) -> RunConfig:
    path = tmp_path / "run.yaml"
    path.write_text(f"loop:\n{loop}")
    return load_config(path, env=env or {})


def test_the_default_is_sync_and_async_defaults_to_max_staleness_one(tmp_path: Path) -> None:
    assert load_config(env={}).loop.mode == "sync"
    config = _load(tmp_path, "  mode: async\n")
    assert (config.loop.mode, config.loop.max_staleness) == ("async", 1)
    assert config.loop.weight_apply == "between_batches"
    config = _load(tmp_path, "  mode: async\n  max_staleness: 0\n")
    assert config.loop.max_staleness == 0
    config = _load(tmp_path, "  mode: async\n  weight_apply: in_flight\n")
    assert config.loop.weight_apply == "in_flight"
    assert _load(tmp_path, "", {"PODRL_LOOP__MODE": "async"}).loop.mode == "async"


@pytest.mark.parametrize(
    ("loop", "expected"),
    [
        ("  mode: asynchronous\n", ["loop.mode", "'sync' or 'async'"]),
        (
            "  mode: async\n  max_staleness: -1\n",
            ["loop.max_staleness", "greater than or equal to 0"],
        ),
        (
            "  mode: async\n  max_staleness: 65\n",
            ["loop.max_staleness", "less than or equal to 64"],
        ),
        (
            "  max_staleness: 2\n",
            ["loop.max_staleness (2) is set but loop.mode is sync", "set loop.mode: async"],
        ),
        (
            "  weight_apply: in_flight\n",
            ["loop.weight_apply is in_flight but loop.mode is sync", "set loop.mode: async"],
        ),
        (
            "  mode: async\n  weight_apply: mid_batch\n",
            ["loop.weight_apply", "'between_batches' or 'in_flight'"],
        ),
    ],
)
def test_bad_values_are_refused_naming_the_field_and_the_fix(
    tmp_path: Path, loop: str, expected: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, loop)
    for part in expected:
        assert part in str(err.value)


def test_a_sync_config_written_out_in_full_loads_again(tmp_path: Path) -> None:
    # Every field set (a dump of the resolved config) includes the default max_staleness.
    from podrl.config import RunConfig

    full = RunConfig.model_validate({"run_dir": str(tmp_path)}).model_dump(mode="json")
    assert RunConfig.model_validate(full).loop.mode == "sync"
