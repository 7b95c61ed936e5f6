"""Environments section of the run config: the environment service and the limits of an episode
(docs/environments.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from podrl.config.base import ServiceSection, check_import_paths

#: The smallest worker memory cap: a worker's interpreter with pebble and podrl's environment
#: module already maps about 80 MiB of address space (78 measured), so a lower cap fails every step.
MIN_WORKER_MEMORY_MIB = 128

ParamValue = int | float | str | bool


class EnvironmentsConfig(ServiceSection):
    grpc_port: int = Field(50054, ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(9104, ge=0, le=65535, description="Prometheus port (0 = off).")
    workers: int = Field(
        2, ge=1, le=256, description="Worker processes that run environment steps in parallel."
    )
    start_method: Literal["forkserver", "spawn"] = Field(
        "forkserver",
        description="How worker processes start: forkserver (fast replacement of dead workers; "
        "plug-in modules preloaded once) or spawn (each worker a fresh interpreter).",
    )
    plugins: dict[str, str] = Field(
        default_factory=dict,
        description="Extra environments by name: {name: 'package.module:Class'}. Reset names "
        "one; each is imported and constructed with its params at start.",
    )
    params: dict[str, dict[str, ParamValue]] = Field(
        default_factory=dict,
        description="Keyword arguments of each environment's class, by environment name "
        "(built-in or plug-in), e.g. {guess_number: {high: 1000, max_guesses: 10}}.",
    )
    max_turns: int = Field(
        8,
        ge=1,
        le=1024,
        description="Turns per episode: the Step of this turn ends an episode the environment "
        "did not end (done and truncated).",
    )
    max_episode_tokens: int = Field(
        1024,
        ge=2,
        description="Tokens per episode: prompt, sampled turns and environment replies together "
        "(every turn is generated over the whole episode, so it must fit "
        "generator.max_model_len; follows it when unset).",
    )
    episodes_in_flight: int = Field(
        64,
        ge=1,
        le=4096,
        description="Episodes the controller's episode runner plays at once per pod and task "
        "(each a thread over blocking gRPC calls; the generator batches their turns).",
    )
    step_timeout_seconds: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Longest one Reset or Step may run in its worker; past it the worker is "
        "killed and replaced, and the episode fails with DEADLINE_EXCEEDED.",
    )
    max_tool_output_chars: int = Field(
        4096,
        ge=1,
        le=1_000_000,
        description="Longest environment reply (characters) shown to the model; a longer one "
        "is cut to this length and reported truncated.",
    )
    worker_memory_mib: int = Field(
        1024,
        ge=MIN_WORKER_MEMORY_MIB,
        description="Address space a worker process may map (RLIMIT_AS); a step that needs more "
        "fails its episode with RESOURCE_EXHAUSTED.",
    )
    max_state_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="Largest pickled environment state the service keeps between two steps of "
        "an episode; a larger one fails the episode with RESOURCE_EXHAUSTED.",
    )
    max_sessions: int = Field(
        4096, ge=1, description="Open episodes at once; a Reset past it is RESOURCE_EXHAUSTED."
    )
    session_idle_seconds: float = Field(
        600.0,
        gt=0,
        description="A session without a Reset, Step or Close for this long is dropped (its "
        "caller went away without closing it).",
    )

    @field_validator("plugins")
    @classmethod
    def _import_paths(cls, plugins: dict[str, str]) -> dict[str, str]:
        return check_import_paths("plugins", plugins, "Class")
