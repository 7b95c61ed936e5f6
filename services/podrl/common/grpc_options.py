"""Channel and server options derived from the run config (message-size bounds, keepalive), and
the one channel factory every podrl client uses (it attaches the caller's run credentials)."""

from __future__ import annotations

import grpc

from podrl.common.auth import AuthClientInterceptor, CallerCredentials
from podrl.config.run_config import GrpcConfig


def channel_options(config: GrpcConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def server_options(config: GrpcConfig) -> list[tuple[str, int]]:
    """Channel options plus: no SO_REUSEPORT. gRPC sets it by default, and then a second
    server on a port already served by another gRPC server binds it too and silently gets a
    share of its calls; without it the second bind fails (a clear 'port in use' at start)."""
    return [*channel_options(config), ("grpc.so_reuseport", 0)]


def open_channel(
    address: str, config: GrpcConfig, credentials: CallerCredentials | None
) -> grpc.Channel:
    """An insecure channel (pod-local / cluster-internal traffic) with bounded message sizes,
    whose every call carries ``credentials`` (None only when the run's auth is disabled)."""
    channel = grpc.insecure_channel(address, options=channel_options(config))
    if credentials is None:
        return channel
    return grpc.intercept_channel(channel, AuthClientInterceptor(credentials))
