"""gRPC Generator service. Generation and weight application arrive with the vLLM engine;
until then those RPCs answer UNIMPLEMENTED (the generated base class does that)."""

from __future__ import annotations

import grpc

import podrl
from podrl.config import RunConfig
from podrl.v1 import common_pb2, generator_pb2, generator_pb2_grpc


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, config: RunConfig) -> None:
        self._config = config

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> generator_pb2.GeneratorInfo:
        return generator_pb2.GeneratorInfo(
            info=common_pb2.ServiceInfo(
                service="podrl.v1.Generator",
                version=podrl.__version__,
                worker_id=self._config.worker_id,
            ),
            policy_version=0,
            device=self._config.device,
        )
