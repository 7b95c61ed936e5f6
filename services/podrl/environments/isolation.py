"""Environment code runs in worker processes, never in the service's own: what runs there (one
Reset or Step of an episode, its result checked and capped, the environment pickled again) and
the check at start of every environment the config names.

Between two steps the service holds an episode's environment as pickled bytes and never
unpickles them: plug-in code (``__init__``, ``reset``, ``step``, ``__setstate__``) runs only in
the workers, where a timeout, a memory cap and a dead process end only that episode.
"""

from __future__ import annotations

import inspect
import math
import pickle
import pkgutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from podrl.config.environments import EnvironmentsConfig, ParamValue
from podrl.config.loading import ConfigError
from podrl.environments.base import StepResult
from podrl.environments.builtins import BUILTIN_ENVIRONMENTS

INTERFACE_HELP = (
    "an environment is a class with reset(prompt, reference, metadata, seed) -> str and "
    "step(action) -> podrl.environments.StepResult; see docs/environments.md"
)


class BrokenInterfaceError(Exception):
    """An environment broke its interface (a reply that is not text, a reward that is not a
    finite number, ...): its episode fails."""


class StateSizeError(BrokenInterfaceError):
    """The pickled environment exceeds ``environments.max_state_bytes``."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """How a worker builds an environment: its class's import path and keyword arguments."""

    name: str
    path: str
    source: str
    """``built-in`` or the configured import path (Info)."""
    params: Mapping[str, ParamValue]


@dataclass(frozen=True)
class Limits:
    max_tool_output_chars: int
    max_state_bytes: int


@dataclass(frozen=True)
class StepOutput:
    """A Reset's or Step's result as the service keeps and sends it."""

    state: bytes
    observation: str
    observation_truncated: bool
    reward: float
    done: bool
    tool_calls: int
    tool_errors: int


def reset_episode(
    spec: EnvironmentSpec,
    prompt: str,
    reference: str,
    metadata: Mapping[str, str],
    seed: int,
    limits: Limits,
) -> StepOutput:
    """Runs in a worker: a new environment of ``spec`` started on the task item."""
    environment = pkgutil.resolve_name(spec.path)(**spec.params)
    observation = environment.reset(prompt, reference, dict(metadata), seed)
    if not isinstance(observation, str):
        raise BrokenInterfaceError(
            f"reset returned {type(observation).__name__}, not str; {INTERFACE_HELP}"
        )
    return _checked(environment, StepResult(observation), limits)


def step_episode(state: bytes, action: str, limits: Limits) -> StepOutput:
    """Runs in a worker: one turn of the environment pickled in ``state``."""
    environment = pickle.loads(state)
    return _checked(environment, environment.step(action), limits)


def _checked(environment: object, result: object, limits: Limits) -> StepOutput:
    if not isinstance(result, StepResult):
        raise BrokenInterfaceError(f"step returned {type(result).__name__}; {INTERFACE_HELP}")
    if not isinstance(result.observation, str):
        raise BrokenInterfaceError(
            f"the observation is {type(result.observation).__name__}, not str; {INTERFACE_HELP}"
        )
    if not isinstance(result.reward, int | float) or not math.isfinite(result.reward):
        raise BrokenInterfaceError(f"the reward {result.reward!r} is not a finite number")
    for name in ("tool_calls", "tool_errors"):
        count = getattr(result, name)
        if not isinstance(count, int) or count < 0:
            raise BrokenInterfaceError(f"{name} {count!r} is not a count (an int >= 0)")
    cap = limits.max_tool_output_chars
    observation = result.observation[:cap]
    # A lone surrogate cannot be sent as protobuf text: it becomes "?".
    observation = observation.encode("utf-8", "replace").decode("utf-8")
    state = pickle.dumps(environment, protocol=pickle.HIGHEST_PROTOCOL)
    if len(state) > limits.max_state_bytes:
        raise StateSizeError(
            f"the environment pickles to {len(state)} bytes, more than "
            f"environments.max_state_bytes ({limits.max_state_bytes}); keep less state in it "
            "or raise the limit"
        )
    return StepOutput(
        state=state,
        observation=observation,
        observation_truncated=len(result.observation) > cap,
        reward=float(result.reward),
        done=bool(result.done),
        tool_calls=result.tool_calls,
        tool_errors=result.tool_errors,
    )


def resolve_environments(config: EnvironmentsConfig) -> dict[str, EnvironmentSpec]:
    """Every environment Reset may name: the built-ins and ``config.plugins``, each class
    imported and its ``config.params`` bound to its constructor's signature (not called: plug-in
    code runs only in workers). A problem raises ConfigError naming the field."""
    classes: dict[str, tuple[Any, str, str]] = {
        name: (cls, f"{cls.__module__}:{cls.__qualname__}", "built-in")
        for name, cls in BUILTIN_ENVIRONMENTS.items()
    }
    for name, path in config.plugins.items():
        field = f"environments.plugins[{name!r}]"
        if name in BUILTIN_ENVIRONMENTS:
            raise ConfigError(f"{field}: {name!r} is a built-in environment; choose another name")
        classes[name] = (_load_class(path, field), path, path)
    unknown = sorted(set(config.params) - set(classes))
    if unknown:
        raise ConfigError(
            f"environments.params: no environment is named {unknown}; the environments are "
            f"{sorted(classes)}"
        )
    specs = {}
    for name, (cls, path, source) in classes.items():
        params = config.params.get(name, {})
        try:
            inspect.signature(cls).bind(**params)
        except TypeError as err:
            raise ConfigError(
                f"environments.params[{name!r}]: {source} {path} does not accept {params}: {err}"
            ) from None
        specs[name] = EnvironmentSpec(name, path, source, dict(params))
    return specs


def _load_class(path: str, field: str) -> type:
    try:
        found = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(
            f"{field}: cannot load {path!r} ({type(err).__name__}: {err}); check the spelling "
            "and that its package is installed in the environment service's image"
        ) from None
    if not isinstance(found, type) or not all(
        callable(getattr(found, method, None)) for method in ("reset", "step")
    ):
        raise ConfigError(f"{field}: {path!r} is not such a class; {INTERFACE_HELP}")
    try:
        pickle.dumps(found)
    except Exception as err:  # a class the workers cannot import by its name
        raise ConfigError(f"{field}: {path!r} cannot be sent to a worker process: {err}") from None
    return found
