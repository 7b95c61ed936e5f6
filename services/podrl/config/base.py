"""Building blocks of the run config: strict sections and the shared service endpoint fields."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """A config section: unknown fields are errors (typos must not pass silently)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ServiceSection(Section):
    """Where a service listens and how others reach it."""

    bind_host: str = Field("127.0.0.1", description="Interface the gRPC server listens on.")
    advertise_host: str = Field(
        "127.0.0.1",
        description="Host other services use to reach this one (the pod IP or DNS name on k8s).",
    )
    grpc_port: int = Field(ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(
        ge=0, le=65535, description="Prometheus /metrics port; 0 disables the endpoint."
    )

    @property
    def address(self) -> str:
        """host:port other services dial."""
        return f"{self.advertise_host}:{self.grpc_port}"
