"""``podrl-grader``: the grader service process."""

from __future__ import annotations

from collections.abc import Sequence

from podrl.common.service import ServiceSpec, serve, worker_spec
from podrl.config import RunConfig
from podrl.grader.servicer import GraderServicer
from podrl.v1 import grader_pb2_grpc


def build_spec(config: RunConfig) -> ServiceSpec:
    return worker_spec(
        "grader", config, GraderServicer(config), grader_pb2_grpc.add_GraderServicer_to_server
    )


def main(argv: Sequence[str] | None = None) -> int:
    return serve("grader", build_spec, argv)
