"""``podrl-generator``: the generator service process."""

from __future__ import annotations

from collections.abc import Sequence

from podrl.common.service import ServiceSpec, serve, worker_spec
from podrl.config import RunConfig
from podrl.generator.servicer import GeneratorServicer
from podrl.v1 import generator_pb2_grpc


def build_spec(config: RunConfig) -> ServiceSpec:
    return worker_spec(
        "generator",
        config,
        GeneratorServicer(config),
        generator_pb2_grpc.add_GeneratorServicer_to_server,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return serve("generator", build_spec, argv)
