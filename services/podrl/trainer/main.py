"""``podrl-trainer``: the trainer service process."""

from __future__ import annotations

from collections.abc import Sequence

from podrl.common.service import ServiceSpec, serve, worker_spec
from podrl.config import RunConfig
from podrl.trainer.servicer import TrainerServicer
from podrl.v1 import trainer_pb2_grpc


def build_spec(config: RunConfig) -> ServiceSpec:
    return worker_spec(
        "trainer", config, TrainerServicer(config), trainer_pb2_grpc.add_TrainerServicer_to_server
    )


def main(argv: Sequence[str] | None = None) -> int:
    return serve("trainer", build_spec, argv)
