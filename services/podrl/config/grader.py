"""Grader section of the run config."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from podrl.config.base import ServiceSection, check_import_paths


class GraderConfig(ServiceSection):
    grpc_port: int = Field(50052, ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(9102, ge=0, le=65535, description="Prometheus port (0 = off).")
    workers: int = Field(
        2, ge=1, le=256, description="Worker processes that run reward functions in parallel."
    )
    item_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="Longest one item's reward functions may run; past it the worker is killed "
        "(and replaced) and the item gets SCORE_ERROR_TIMEOUT and the fallback reward.",
    )
    fallback_reward: float = Field(
        0.0,
        description="Reward of an item whose scoring failed (error, timeout, dead worker, "
        "unknown task); a task's own fallback_reward overrides it.",
    )
    reward_plugins: dict[str, str] = Field(
        default_factory=dict,
        description="Extra reward functions by short name: {name: 'package.module:function'}. "
        "Tasks refer to them by name; each is imported and signature-checked at start.",
    )
    start_method: Literal["forkserver", "spawn"] = Field(
        "forkserver",
        description="How worker processes start: forkserver (fast replacement of dead workers; "
        "reward modules preloaded once) or spawn (each worker a fresh interpreter).",
    )

    @field_validator("reward_plugins")
    @classmethod
    def _import_paths(cls, plugins: dict[str, str]) -> dict[str, str]:
        return check_import_paths("reward_plugins", plugins, "function")
