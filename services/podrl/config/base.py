"""Building blocks of the run config: strict sections, the shared service endpoint fields and
the check of plug-in import paths."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


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


def check_import_paths(field: str, paths: dict[str, str], kind: str) -> dict[str, str]:
    """``paths`` ({name: 'package.module:Attribute'}, plug-ins by name) as given, or ValueError
    naming the first entry that is no import path of a ``kind`` (function, Class)."""
    for name, path in paths.items():
        if not _IMPORT_PATH.match(path):
            raise ValueError(f"{field}[{name!r}]: {path!r} is not 'package.module:{kind}'")
    return paths
