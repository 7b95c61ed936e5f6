"""gRPC clients the controller uses to drive workers: cached channels, a deadline on every call."""

from __future__ import annotations

import threading

import grpc

from podrl.common.auth import CallerCredentials
from podrl.common.grpc_options import open_channel
from podrl.config.transport import GrpcConfig
from podrl.v1 import generator_pb2_grpc, grader_pb2_grpc, trainer_pb2_grpc


class WorkerClients:
    """One channel per worker address, reused across steps; closed on shutdown. Every call
    carries ``credentials`` (the controller's; None only when the run's auth is disabled)."""

    def __init__(self, config: GrpcConfig, credentials: CallerCredentials | None = None) -> None:
        self.config = config
        self.credentials = credentials
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(
                    address, self.config, self.credentials
                )
            return channel

    def generator(self, address: str) -> generator_pb2_grpc.GeneratorStub:
        return generator_pb2_grpc.GeneratorStub(self._channel(address))

    def grader(self, address: str) -> grader_pb2_grpc.GraderStub:
        return grader_pb2_grpc.GraderStub(self._channel(address))

    def trainer(self, address: str) -> trainer_pb2_grpc.TrainerStub:
        return trainer_pb2_grpc.TrainerStub(self._channel(address))

    @property
    def short(self) -> float:
        """Deadline of control calls."""
        return self.config.call_timeout_seconds

    @property
    def long(self) -> float:
        """Deadline of work calls (generate, score, train, checkpoint)."""
        return self.config.long_call_timeout_seconds

    def forget(self, address: str) -> None:
        """Drop the channel to ``address``: the process there was replaced (a channel to the
        old one may sit in reconnect backoff and fail calls to the new one at once)."""
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
