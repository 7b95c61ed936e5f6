"""Channel and server options derived from the run config (message-size bounds, keepalive)."""

from __future__ import annotations

import grpc

from podrl.config.run_config import GrpcConfig


def channel_options(config: GrpcConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


def open_channel(address: str, config: GrpcConfig) -> grpc.Channel:
    """An insecure channel (pod-local / cluster-internal traffic) with bounded message sizes."""
    return grpc.insecure_channel(address, options=channel_options(config))
