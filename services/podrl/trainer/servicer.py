"""gRPC Trainer service. Training, publishing and checkpoints arrive with the model stack;
until then those RPCs answer UNIMPLEMENTED (the generated base class does that)."""

from __future__ import annotations

import grpc

import podrl
from podrl.config import RunConfig
from podrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, config: RunConfig) -> None:
        self._config = config

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainerInfo:
        return trainer_pb2.TrainerInfo(
            info=common_pb2.ServiceInfo(
                service="podrl.v1.Trainer",
                version=podrl.__version__,
                worker_id=self._config.worker_id,
            ),
            world_size=1,
        )
