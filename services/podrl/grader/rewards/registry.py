"""Resolve the reward functions a config names and check them once, at start.

A reward is named by a built-in name (``BUILTIN_REWARDS``), a short name from
``grader.reward_plugins``, or an import path ``package.module:function``. Every function must
accept ``(completion, reference, **params)`` for the task's configured params; it may also take
``prompt``, ``task`` and ``metadata`` by keyword. Problems raise ConfigError naming the field.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import re
from collections.abc import Callable, Mapping
from typing import Any

from podrl.config.grader import GraderConfig
from podrl.config.loading import ConfigError
from podrl.config.tasks import RewardConfig, TasksConfig
from podrl.grader.rewards.scoring import (
    BUILTIN_REWARDS,
    CONTEXT_ARGUMENTS,
    RewardComponent,
    TaskRewardPlan,
)

SIGNATURE_HELP = (
    "a reward function is `def reward(completion: str, reference: str, **params) -> float` "
    "(it may also take prompt=, task=, metadata= by keyword); see docs/grader.md"
)


def load_import_path(path: str, field: str) -> Callable[..., Any]:
    """``package.module:function`` -> the function; ConfigError naming ``field`` otherwise."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ConfigError(f"{field}: {path!r} is not 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(
            f"{field}: cannot import module {module_name!r} for {path!r} ({err}); check the "
            "spelling and that the package is installed in the grader's environment"
        ) from None
    except Exception as err:
        raise ConfigError(
            f"{field}: importing {module_name!r} for {path!r} failed: {type(err).__name__}: {err}"
        ) from None
    function = getattr(module, attribute, None)
    if function is None:
        raise ConfigError(f"{field}: module {module_name!r} has no attribute {attribute!r}")
    if not callable(function):
        raise ConfigError(
            f"{field}: {path!r} is a {type(function).__name__}, not a function; {SIGNATURE_HELP}"
        )
    return function


def resolve_reward(
    name: str, plugins: Mapping[str, str], field: str
) -> tuple[Callable[..., Any], str]:
    """The function ``name`` refers to, and a description of where it came from."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name], f"built-in {name}"
    if name in plugins:
        path = plugins[name]
        return load_import_path(path, f"grader.reward_plugins[{name!r}] (used by {field})"), path
    if ":" in name:
        return load_import_path(name, field), name
    known = sorted([*BUILTIN_REWARDS, *plugins])
    raise ConfigError(
        f"{field}: unknown reward {name!r}; use one of {known}, add it to grader.reward_plugins, "
        "or give an import path 'package.module:function'"
    )


def accepted_context(function: Callable[..., Any]) -> tuple[str, ...]:
    """Which context keywords (prompt, task, metadata) ``function`` takes."""
    parameters = inspect.signature(function).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return CONTEXT_ARGUMENTS
    return tuple(
        name
        for name in CONTEXT_ARGUMENTS
        if name in parameters and parameters[name].kind is not inspect.Parameter.POSITIONAL_ONLY
    )


def check_signature(
    function: Callable[..., Any], params: Mapping[str, Any], source: str, field: str
) -> tuple[str, ...]:
    """Check that ``function(completion, reference, **params, **context)`` binds; returns the
    context keywords it takes."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        raise ConfigError(f"{field}: cannot read the signature of {source}") from None
    context = accepted_context(function)
    clash = sorted(set(params) & set(CONTEXT_ARGUMENTS))
    if clash:
        raise ConfigError(f"{field}.params: {clash} are passed by the grader; remove them")
    try:
        signature.bind("completion", "reference", **params, **dict.fromkeys(context))
    except TypeError as err:
        raise ConfigError(
            f"{field}: {source} has signature {signature}, which does not accept "
            f"(completion, reference, **{dict(params)!r}): {err}; {SIGNATURE_HELP}"
        ) from None
    try:
        pickle.dumps(function)
    except Exception:
        raise ConfigError(
            f"{field}: {source} cannot be sent to a worker process (it must be a module-level "
            "function, not a lambda, closure or method)"
        ) from None
    return context


def _check_builtin_params(config: RewardConfig, field: str) -> None:
    if config.name == "regex_match" and isinstance(config.params.get("pattern"), str):
        try:
            re.compile(config.params["pattern"])
        except re.error as err:
            raise ConfigError(
                f"{field}.params.pattern: invalid regular expression: {err}"
            ) from None
    if config.name == "length_penalty":
        max_chars = config.params.get("max_chars")
        free_chars = config.params.get("free_chars", 0)
        if isinstance(max_chars, int) and isinstance(free_chars, int) and max_chars <= free_chars:
            raise ConfigError(f"{field}.params: max_chars must exceed free_chars")


def build_reward_plans(tasks: TasksConfig, grader: GraderConfig) -> dict[str, TaskRewardPlan]:
    """One checked plan per task; raises ConfigError naming the first bad field."""
    plans = {}
    for number, task in enumerate(tasks.definitions):
        components = []
        for index, reward in enumerate(task.rewards):
            field = f"tasks.definitions[{number}].rewards[{index}]"
            function, source = resolve_reward(reward.name, grader.reward_plugins, f"{field}.name")
            if reward.name in BUILTIN_REWARDS:
                _check_builtin_params(reward, field)
            where = field
            if reward.name in grader.reward_plugins:
                where = f"{field} (via grader.reward_plugins[{reward.name!r}])"
            context = check_signature(function, reward.params, source, where)
            components.append(
                RewardComponent(
                    label=reward.component,
                    function=function,
                    weight=reward.weight,
                    params=dict(reward.params),
                    context=context,
                    source=source,
                )
            )
        fallback = task.fallback_reward
        plans[task.name] = TaskRewardPlan(
            task=task.name,
            components=tuple(components),
            fallback_reward=grader.fallback_reward if fallback is None else fallback,
        )
    return plans


_HEAVY_IMPORTS = {"reasoning_gym": "reasoning_gym", "math_verify": "math_verify"}
"""Built-ins that import a large library on first use, and that library."""


def preload_modules(plans: Mapping[str, TaskRewardPlan]) -> list[str]:
    """Modules the worker pool imports once up front: the plans' function modules and the
    libraries the built-ins they use import lazily."""
    modules = set()
    for plan in plans.values():
        for component in plan.components:
            modules.add(component.function.__module__)
            builtin = component.source.removeprefix("built-in ")
            if component.source.startswith("built-in ") and builtin in _HEAVY_IMPORTS:
                modules.add(_HEAVY_IMPORTS[builtin])
    return sorted(modules)
