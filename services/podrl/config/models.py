"""Typed run configuration.

One YAML file (``podrl run CONFIG`` / ``--config``) describes the whole run; every service reads
the same file and uses its own section. Any field can be overridden from the environment as
``PODRL_<SECTION>__<FIELD>`` (e.g. ``PODRL_GENERATOR__GRPC_PORT=6000``), which is how the local
launcher, docker-compose and the Helm chart assign ports and addresses.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Port = int


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class GrpcConfig(_Section):
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


class LogConfig(_Section):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")
    format: Literal["json", "text"] = Field(
        "json", description="json: one JSON object per line (for log shippers); text: for humans."
    )


class _ServiceSection(_Section):
    bind_host: str = Field("127.0.0.1", description="Interface the gRPC server listens on.")
    advertise_host: str = Field(
        "127.0.0.1",
        description="Host other services use to reach this one (the pod IP or DNS name on k8s).",
    )
    grpc_port: Port = Field(ge=1, le=65535, description="gRPC port.")
    metrics_port: Port = Field(
        ge=0, le=65535, description="Prometheus /metrics port; 0 disables the endpoint."
    )

    @property
    def address(self) -> str:
        """host:port other services dial."""
        return f"{self.advertise_host}:{self.grpc_port}"


class ControllerConfig(_ServiceSection):
    """The controller: run loop, membership, REST status."""

    grpc_port: Port = Field(50050, ge=1, le=65535, description="gRPC port (Register, Heartbeat).")
    metrics_port: Port = Field(
        0, ge=0, le=0, description="Unused: the controller serves /metrics on its REST port."
    )
    http_port: Port = Field(8080, ge=1, le=65535, description="REST API, dashboard and /metrics.")
    heartbeat_interval_seconds: float = Field(
        2.0, gt=0, le=60, description="How often each registered process sends a heartbeat."
    )
    heartbeat_timeout_seconds: float = Field(
        10.0, gt=0, description="A process silent for this long is reported unhealthy."
    )
    min_worker_pods: int = Field(
        1, ge=0, description="/readyz answers 200 once this many complete worker pods are healthy."
    )


class GeneratorConfig(_ServiceSection):
    grpc_port: Port = Field(50051, ge=1, le=65535, description="gRPC port.")
    metrics_port: Port = Field(9101, ge=0, le=65535, description="Prometheus port (0 = off).")


class GraderConfig(_ServiceSection):
    grpc_port: Port = Field(50052, ge=1, le=65535, description="gRPC port.")
    metrics_port: Port = Field(9102, ge=0, le=65535, description="Prometheus port (0 = off).")


class TrainerConfig(_ServiceSection):
    grpc_port: Port = Field(50053, ge=1, le=65535, description="gRPC port.")
    metrics_port: Port = Field(9103, ge=0, le=65535, description="Prometheus port (0 = off).")


class RunConfig(_Section):
    """The whole run. Every field has a working default for a local CPU run."""

    name: str = Field("podrl", min_length=1, description="Run name (status pages, metrics).")
    run_dir: Path = Field(
        Path("runs/podrl"), description="Checkpoints, samples and metrics history go here."
    )
    worker_id: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        description="The worker pod this process belongs to (the pod name on k8s).",
    )
    device: Literal["cpu", "cuda", "auto"] = Field(
        "auto", description="cpu, cuda, or auto (cuda when available)."
    )
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    grader: GraderConfig = Field(default_factory=GraderConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
