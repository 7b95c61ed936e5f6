"""Client-side checks of running services: gRPC health, REST readiness."""

from __future__ import annotations

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc


def grpc_health(address: str, service: str = "", timeout: float = 2.0) -> str:
    """The health status name (SERVING, NOT_SERVING, ...) or the gRPC error code name."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def http_ready(url: str, timeout: float = 2.0, client: httpx.Client | None = None) -> bool:
    """GET ``url`` answers 200 (through ``client`` when given: a new one per call costs a TLS
    context, tens of milliseconds of CPU)."""
    try:
        if client is None:
            return httpx.get(url, timeout=timeout).status_code == 200
        return client.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False
