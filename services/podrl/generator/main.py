"""``podrl-generator``: the generator service process.

Start-up: the gRPC server starts at once (health NOT_SERVING), then the model folder is made
ready (the tiny model is written only where the config asks for it,
``podrl.models.folders.may_write_tiny_model``), the shared memory of vLLM engines whose
generator was killed is unlinked, and the vLLM engine loads; only then does health turn SERVING
and the generator register with the controller. On SIGTERM the engine shuts down
after in-flight RPCs finished (``on_close``).
"""

from __future__ import annotations

from collections.abc import Sequence

from podrl.common.service import ServiceSpec, serve, worker_spec
from podrl.config import RunConfig
from podrl.generator import engine_processes
from podrl.generator.engine_build import VllmEngine
from podrl.generator.servicer import GeneratorServicer
from podrl.models.folders import ensure_model_folder, may_write_tiny_model
from podrl.v1 import generator_pb2_grpc


def build_spec(config: RunConfig) -> ServiceSpec:
    gen = config.generator
    model_path = gen.resolved_model_path(config.run_dir)
    engine = VllmEngine(
        gen, model_path, trusted_publisher_id=gen.trusted_publisher_id or config.worker_id
    )
    servicer = GeneratorServicer(config, engine)

    def load_engine() -> None:
        ensure_model_folder(model_path, may_write_tiny_model(gen))
        # Segments of an engine whose generator was killed (podrl.generator.engine_processes).
        engine_processes.reap_dead_engine_segments()
        engine_processes.reap_dead_socket_dirs()
        engine.start()
        servicer.mark_ready()

    spec = worker_spec(
        "generator",
        config,
        servicer,
        generator_pb2_grpc.add_GeneratorServicer_to_server,
        on_close=[engine.close],
        until_ready=load_engine,
    )
    spec.details.update(model=str(model_path), dtype=gen.dtype)
    spec.policy_version = lambda: engine.policy_version
    return spec


def main(argv: Sequence[str] | None = None) -> int:
    return serve("generator", build_spec, argv)


if __name__ == "__main__":
    raise SystemExit(main())
