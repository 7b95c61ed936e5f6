"""gRPC transport and logging settings shared by every service."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from podrl.config.base import Section


class GrpcConfig(Section):
    """gRPC transport settings shared by every server and client."""

    max_message_bytes: int = Field(
        256 * 1024 * 1024,
        ge=1024,
        le=2**31 - 1,
        description="Largest message a server accepts or a client sends/receives.",
    )
    call_timeout_seconds: float = Field(
        30.0, gt=0, description="Deadline for short control RPCs (health, register, info)."
    )
    long_call_timeout_seconds: float = Field(
        1800.0, gt=0, description="Deadline for work RPCs (generate, score, train)."
    )
    max_workers: int = Field(16, ge=1, le=1024, description="Server thread-pool size.")
    shutdown_grace_seconds: float = Field(
        10.0, ge=0, description="On SIGTERM, how long in-flight RPCs may run before they are cut."
    )
    keepalive_seconds: float = Field(
        30.0,
        ge=1.0,
        le=7200.0,
        description="How often a client pings a server it is connected to (during a call and "
        "between calls) to find a peer that is gone; servers accept pings this often.",
    )
    keepalive_timeout_seconds: float = Field(
        10.0,
        ge=1.0,
        le=3600.0,
        description="How long a client waits for a ping's answer before it deems the "
        "connection dead (its calls then fail with UNAVAILABLE).",
    )


class LogConfig(Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    format: Literal["json", "text"] = Field(
        "json", description="json: one JSON object per line (for log shippers); text: for humans."
    )
