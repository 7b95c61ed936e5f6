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
        ("grpc.keepalive_time_ms", round(config.keepalive_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", round(config.keepalive_timeout_seconds * 1000)),
        # Ping between calls too: a peer that went away while idle is found before the next
        # call waits on it.
        ("grpc.keepalive_permit_without_calls", 1),
        # No cap on pings while no data moves: gRPC's default (2) holds keepalive back after
        # two pings of a long silent call (a Train, a SaveCheckpoint), so a dead peer would be
        # found later than keepalive_seconds says.
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options(config: GrpcConfig) -> list[tuple[str, int]]:
    """Channel options, a ping policy that accepts the clients' keepalive, and no SO_REUSEPORT.

    gRPC's default server policy accepts a ping without data only every 5 minutes and, at the
    third early one, ends the connection (GOAWAY ENHANCE_YOUR_CALM "too_many_pings"): every call
    on it fails with UNAVAILABLE, so a Train longer than a few minutes was cut and sent again.
    Here a ping is early only below half the clients' interval (timers are not exact, and a
    silent call never forgives a strike); a peer pinging faster is still cut at its third early
    ping.

    gRPC sets SO_REUSEPORT by default, and then a second server on a port already served by
    another gRPC server binds it too and silently gets a share of its calls; without it the
    second bind fails (a clear 'port in use' at start)."""
    return [
        *channel_options(config),
        ("grpc.http2.min_ping_interval_without_data_ms", round(config.keepalive_seconds * 500)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),
    ]


def open_channel(
    address: str, config: GrpcConfig, credentials: CallerCredentials | None
) -> grpc.Channel:
    """An insecure channel (pod-local / cluster-internal traffic) with bounded message sizes,
    whose every call carries ``credentials`` (None only when the run's auth is disabled)."""
    channel = grpc.insecure_channel(address, options=channel_options(config))
    if credentials is None:
        return channel
    return grpc.intercept_channel(channel, AuthClientInterceptor(credentials))
