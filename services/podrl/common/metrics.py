"""Prometheus metrics common to every service, and the gRPC interceptor that fills them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

RPC_STARTED = Counter(
    "podrl_grpc_server_started_total", "RPCs received.", ["grpc_service", "grpc_method"]
)
RPC_HANDLED = Counter(
    "podrl_grpc_server_handled_total",
    "RPCs completed, by status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
)
RPC_SECONDS = Histogram(
    "podrl_grpc_server_handling_seconds",
    "RPC handling time.",
    ["grpc_service", "grpc_method"],
    buckets=(0.001, 0.005, 0.02, 0.1, 0.5, 2, 10, 60, 300),
)
RPC_IN_FLIGHT = Gauge("podrl_grpc_server_in_flight", "RPCs being handled now.")
SERVICE_UP = Gauge(
    "podrl_service_serving", "1 while the service reports SERVING.", ["service", "worker_id"]
)


def _split_method(full_method: str) -> tuple[str, str]:
    # "/podrl.v1.Generator/Generate" → ("podrl.v1.Generator", "Generate")
    _, service, method = full_method.split("/", 2)
    return service, method


class MetricsInterceptor(grpc.ServerInterceptor):
    """Counts and times every unary RPC by service, method and final status code."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        service, method = _split_method(handler_call_details.method)
        behavior = handler.unary_unary

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            RPC_STARTED.labels(service, method).inc()
            RPC_IN_FLIGHT.inc()
            start = time.perf_counter()
            code = "UNKNOWN"
            try:
                response = behavior(request, context)
                code = (context.code() or grpc.StatusCode.OK).name
                return response
            except Exception:
                code = (context.code() or grpc.StatusCode.UNKNOWN).name
                raise
            finally:
                RPC_IN_FLIGHT.dec()
                RPC_SECONDS.labels(service, method).observe(time.perf_counter() - start)
                RPC_HANDLED.labels(service, method, code).inc()

        return grpc.unary_unary_rpc_method_handler(
            timed,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
