"""Generator section of the run config."""

from __future__ import annotations

from pydantic import Field

from podrl.config.base import ServiceSection


class GeneratorConfig(ServiceSection):
    grpc_port: int = Field(50051, ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(9101, ge=0, le=65535, description="Prometheus port (0 = off).")
