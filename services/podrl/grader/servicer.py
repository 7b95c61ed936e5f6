"""gRPC Grader service. Scoring arrives with the reward registry; until then `Score` answers
UNIMPLEMENTED (the generated base class does that)."""

from __future__ import annotations

import grpc

import podrl
from podrl.config import RunConfig
from podrl.v1 import common_pb2, grader_pb2, grader_pb2_grpc


class GraderServicer(grader_pb2_grpc.GraderServicer):
    def __init__(self, config: RunConfig) -> None:
        self._config = config

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> grader_pb2.GraderInfo:
        return grader_pb2.GraderInfo(
            info=common_pb2.ServiceInfo(
                service="podrl.v1.Grader",
                version=podrl.__version__,
                worker_id=self._config.worker_id,
            )
        )
