"""Controller section of the run config."""

from __future__ import annotations

from pydantic import Field, model_validator

from podrl.config.base import ServiceSection


class ControllerConfig(ServiceSection):
    """The controller: run loop, membership, REST status."""

    grpc_port: int = Field(50050, ge=1, le=65535, description="gRPC port (Register, Heartbeat).")
    metrics_port: int = Field(
        0, ge=0, le=0, description="Unused: the controller serves /metrics on its REST port."
    )
    http_port: int = Field(8080, ge=1, le=65535, description="REST API, dashboard and /metrics.")
    heartbeat_interval_seconds: float = Field(
        2.0, gt=0, le=60, description="How often each registered process sends a heartbeat."
    )
    heartbeat_timeout_seconds: float = Field(
        10.0, gt=0, description="A process silent for this long is reported unhealthy."
    )
    min_worker_pods: int = Field(
        1, ge=0, description="/readyz answers 200 once this many complete worker pods are healthy."
    )
    worker_pods: int = Field(
        1,
        ge=1,
        description="Worker pods wanted at start outside a cluster (podrl up/run --pods sets "
        "it); PUT /v1/workers/replicas and podrl scale change it. In a cluster the worker "
        "StatefulSet's replicas are the count and this is unused.",
    )
    max_worker_pods: int = Field(
        8,
        ge=1,
        le=1024,
        description="The most worker pods PUT /v1/workers/replicas and podrl scale may ask for "
        "(a larger count is refused with 422).",
    )
    loop_call_threads: int = Field(
        16,
        ge=1,
        le=1024,
        description="Threads of the loop's calls to the worker pods (each phase sends one "
        "call per pod at once: Generate, Score, Train, ApplyWeights): a step with more pods "
        "than this sends the rest as threads free up.",
    )
    episode_view_chars: int = Field(
        20_000,
        ge=1_000,
        le=1_000_000,
        description="Characters of text the latest episode shows in all (/v1/episodes/latest "
        "and the dashboard: its prompt, each turn's action and reply, its error), shared "
        "evenly by its texts, each at least 32; a longer text is cut.",
    )

    @model_validator(mode="after")
    def _check_pod_counts(self) -> ControllerConfig:
        for name in ("worker_pods", "min_worker_pods"):
            if getattr(self, name) > self.max_worker_pods:
                raise ValueError(
                    f"controller.{name} ({getattr(self, name)}) is above "
                    f"controller.max_worker_pods ({self.max_worker_pods}); raise "
                    "max_worker_pods or lower it"
                )
        return self
