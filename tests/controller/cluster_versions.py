"""The policy versions a local cluster's trainer and generator report over gRPC."""

from __future__ import annotations

from typing import Any

from podrl.cli.local_cluster import LocalCluster
from podrl.common.grpc_options import open_channel
from podrl.config.transport import GrpcConfig
from podrl.v1 import common_pb2, generator_pb2_grpc, trainer_pb2_grpc


def policy_versions(cluster: LocalCluster) -> tuple[Any, Any]:
    """The trainer's and the generator's Info (policy versions) as they answer now."""
    with open_channel(
        cluster.child("trainer").grpc_address, GrpcConfig(), cluster.credentials()
    ) as channel:
        trainer = trainer_pb2_grpc.TrainerStub(channel).Info(common_pb2.InfoRequest(), timeout=10)
    with open_channel(
        cluster.child("generator").grpc_address, GrpcConfig(), cluster.credentials()
    ) as channel:
        generator = generator_pb2_grpc.GeneratorStub(channel).Info(
            common_pb2.InfoRequest(), timeout=10
        )
    return trainer, generator
