"""The run config: YAML + environment, validated once, errors that name the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from podrl.config import ConfigError, load_config


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_are_valid() -> None:
    config = load_config(env={})
    assert config.controller.grpc_port == 50050
    assert config.generator.address == "127.0.0.1:50051"


def test_yaml_and_environment_overrides(tmp_path: Path) -> None:
    path = _write(tmp_path, "name: exp1\ngenerator:\n  grpc_port: 6001\n")
    config = load_config(path, env={"PODRL_GENERATOR__GRPC_PORT": "6002", "PODRL_NAME": "exp2"})
    assert config.generator.grpc_port == 6002  # the environment wins over the file
    assert config.name == "exp2"
    assert load_config(path, env={}).generator.grpc_port == 6001


@pytest.mark.parametrize(
    ("yaml_text", "env", "must_mention"),
    [
        ("generator:\n  grpc_port: 70000\n", {}, ["generator.grpc_port", "65535"]),
        ("log:\n  level: LOUD\n", {}, ["log.level", "'DEBUG'", "'ERROR'"]),
        ("device: tpu\n", {}, ["device", "'cpu'", "'cuda'"]),
        ("grader:\n  grcp_port: 1\n", {}, ["grader.grcp_port", "unknown field"]),
        ("", {"PODRL_TRAINER__GRPC_PORT": "abc"}, ["trainer.grpc_port", "PODRL_*"]),
        ("generator: [1, 2]\n", {}, ["generator"]),
    ],
)
def test_bad_values_name_the_field(
    tmp_path: Path, yaml_text: str, env: dict[str, str], must_mention: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, yaml_text), env=env)
    for text in must_mention:
        assert text in str(err.value)


def test_unreadable_files_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml", env={})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(_write(tmp_path, "a: [1,\n"), env={})
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(_write(tmp_path, "- 1\n"), env={})


@pytest.mark.parametrize("service", ["controller", "grader"])
def test_a_service_with_a_bad_config_fails_at_start(tmp_path: Path, service: str) -> None:
    path = _write(tmp_path, f"{service}:\n  grpc_port: -5\n")
    result = subprocess.run(
        [sys.executable, "-m", f"podrl.{service}", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PODRL_RUN_DIR": str(tmp_path)},
    )
    assert result.returncode == 2
    assert f"{service}.grpc_port" in result.stderr


def test_podrl_up_rejects_a_bad_config_before_starting_anything(tmp_path: Path) -> None:
    path = _write(tmp_path, "controller:\n  http_port: 0\n")
    result = subprocess.run(
        [sys.executable, "-m", "podrl.cli", "up", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "controller.http_port" in result.stderr


TOO_LONG_PROMPT = """
loop: {steps: 2, sampling: {max_tokens: 12}}
generator: {max_model_len: 16}
tasks:
  definitions:
    - name: copy
      source: {kind: procedural, generator: copy, max_length: 3, alphabet: abc}
      template: "{question}"
      rewards: [{name: exact_match}]
"""


@pytest.mark.parametrize(
    "command", [["podrl.controller", "--config"], ["podrl.cli", "run"]], ids=["controller", "run"]
)
def test_a_prompt_too_long_for_the_model_stops_the_start(
    tmp_path: Path, command: list[str]
) -> None:
    # Loading renders no prompt; the controller's start (and `podrl run` before it starts
    # anything) renders each task's longest prompt and refuses one that cannot fit.
    path = _write(tmp_path, TOO_LONG_PROMPT)
    load_config(path, env={})
    result = subprocess.run(
        [sys.executable, "-m", *command, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PODRL_RUN_DIR": str(tmp_path / "run")},
    )
    assert result.returncode == 2, result.stderr
    for words in ("loop.sampling.max_tokens", "generator.max_model_len", "'copy'"):
        assert words in result.stderr
    assert not (tmp_path / "run" / "logs").exists()  # nothing was started
