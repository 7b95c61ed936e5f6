"""Load a RunConfig from YAML plus ``PODRL_*`` environment overrides, validated once."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from podrl.config.coupling import CoupledFieldsError
from podrl.config.run_config import RunConfig

ENV_PREFIX = "PODRL_"
ENV_NESTING = "__"
# PODRL_* variables that are not run-config overrides: the config file itself, the run's
# shared secret (a file, or the value; read by podrl.common.auth, never part of the config), the
# pod's weights key file (podrl.weights.protocol) and the fault plan of chaos tests
# (podrl.common.faults).
NOT_OVERRIDES = frozenset(
    {
        "PODRL_CONFIG",
        "PODRL_RUN_SECRET_FILE",
        "PODRL_RUN_SECRET",
        "PODRL_WEIGHTS_KEY_FILE",
        "PODRL_FAULTS",
    }
)


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names each bad field and the fix."""


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """``PODRL_GENERATOR__GRPC_PORT=6000`` → ``{"generator": {"grpc_port": "6000"}}``.

    Values stay strings (pydantic converts them) unless they are JSON lists/objects.
    """
    overrides: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or key in NOT_OVERRIDES:
            continue
        path = [part.lower() for part in key[len(ENV_PREFIX) :].split(ENV_NESTING)]
        value: Any = raw
        if raw[:1] in "[{":
            with contextlib.suppress(json.JSONDecodeError):
                value = json.loads(raw)
        node = overrides
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment variable {key} conflicts with another override")
        node[path[-1]] = value
    return overrides


def _env_name(where: str, key: object) -> str:
    """The variable that sets ``key`` under ``where`` ("" = the root)."""
    return f"{where}{ENV_NESTING}{key}".upper() if where else f"{ENV_PREFIX}{key}".upper()


def _is_index_map(value: Any) -> bool:
    """``{"0": {...}}``: what ``PODRL_TASKS__DEFINITIONS__0__NAME`` makes of a list item."""
    return isinstance(value, Mapping) and bool(value) and all(str(k).isdigit() for k in value)


def _merge_into_list(base: list[Any], override: Mapping[str, Any], where: str) -> list[Any]:
    """Items of ``base`` overridden by index; the next free index appends an item."""
    merged = list(base)
    for key, value in sorted(override.items(), key=lambda item: int(item[0])):
        index, name = int(key), _env_name(where, key)
        if index > len(merged):
            raise ConfigError(
                f"environment variable {name}{ENV_NESTING}...: the list {where} sets holds "
                f"{len(merged)} item(s); override one of items 0 to {len(merged) - 1} or add "
                f"item {len(merged)}"
            )
        if index == len(merged):
            merged.append(_merge_value(None, value, name))
        else:
            merged[index] = _merge_value(merged[index], value, name)
    return merged


def _merge_value(current: Any, value: Any, where: str) -> Any:
    if isinstance(value, Mapping) and isinstance(current, Mapping):
        return _deep_merge(dict(current), value, where)
    if _is_index_map(value):  # a list item's field (a validation error's hint names it so)
        return _merge_into_list(current if isinstance(current, list) else [], value, where)
    if isinstance(value, Mapping):
        return _deep_merge({}, value, where)
    return value


def _deep_merge(
    base: dict[str, Any], override: Mapping[str, Any], where: str = ""
) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _merge_value(merged.get(key), value, _env_name(where, key))
    return merged


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for problem in err.errors():
        cause = problem.get("ctx", {}).get("error")
        if isinstance(cause, CoupledFieldsError):  # two sections disagree: the rule says why
            lines.extend(f"  {coupled}" for coupled in cause.problems)
            continue
        field = ".".join(str(part) for part in problem["loc"]) or "<root>"
        env_name = ENV_PREFIX + ENV_NESTING.join(str(p).upper() for p in problem["loc"])
        got = problem.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        hint = (
            "remove it (unknown field; check the spelling)"
            if problem["type"] == "extra_forbidden"
            else f"set it in the YAML file or as {env_name}"
        )
        lines.append(f"  {field}: {problem['msg']}{got_text}; {hint}")
    return "\n".join(lines)


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> RunConfig:
    """Read ``path`` (YAML; optional), apply ``PODRL_*`` overrides from ``env`` and validate.

    ``env`` defaults to ``os.environ``; ``PODRL_CONFIG`` names the file when ``path`` is None.
    Raises ConfigError with one line per bad field.
    """
    env = os.environ if env is None else env
    path = path if path is not None else env.get("PODRL_CONFIG")
    data: dict[str, Any] = {}
    source = "defaults"
    if path:
        file = Path(path)
        try:
            loaded = yaml.safe_load(file.read_text()) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {file} does not exist") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file} is not valid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(
                f"config file {file} must hold a mapping, not {type(loaded).__name__}"
            )
        data = loaded
        source = str(file)
    overrides = _env_overrides(env)
    if overrides:
        source += " + PODRL_* environment"
    try:
        return RunConfig.model_validate(_deep_merge(data, overrides))
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None
