"""``podrl-controller``: gRPC membership service, REST API and (when configured) the GRPO loop."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import uvicorn

from podrl.common.service import ServiceSpec, serve
from podrl.config import RunConfig
from podrl.controller.clients import WorkerClients
from podrl.controller.loop import GrpoLoop
from podrl.controller.membership import MemberRegistry
from podrl.controller.rest import build_rest_app
from podrl.controller.run_store import RunStore
from podrl.controller.servicer import ControllerServicer
from podrl.controller.status import RunState
from podrl.tasks import build_task_source
from podrl.v1 import controller_pb2_grpc


class RestServer:
    """uvicorn in a background thread; the main thread owns signals (see common.service)."""

    def __init__(self, app: object, host: str, port: int) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="rest", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class LoopRunner:
    """Runs the GRPO loop in a thread. stop() lets the step in flight finish (its retries end
    early), then the loop checkpoints and ends; stop() returns when it has."""

    def __init__(self, loop: GrpoLoop) -> None:
        self._loop = loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=loop.run, args=(self._stop,), name="grpo-loop")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def build_spec(config: RunConfig) -> ServiceSpec:
    section = config.controller
    registry = MemberRegistry(section.heartbeat_timeout_seconds)
    state = RunState(config.name, registry, section.min_worker_pods, config.loop.steps)
    store = RunStore(config.run_dir / "controller.sqlite")
    servicer = ControllerServicer(state, section.heartbeat_interval_seconds)
    side_servers: list = [
        RestServer(build_rest_app(state, store), section.bind_host, section.http_port)
    ]
    clients = WorkerClients(config.grpc)
    on_drain = []
    if config.loop.steps:
        source = build_task_source(config.tasks)  # a bad task config fails here, at start
        runner = LoopRunner(GrpoLoop(config, state, store, clients, source))
        side_servers.append(runner)
        on_drain.append(runner.stop)  # stop (and checkpoint) while workers can still answer
    return ServiceSpec(
        name="controller",
        grpc_service="podrl.v1.Controller",
        section=section,
        add_servicers=lambda server: controller_pb2_grpc.add_ControllerServicer_to_server(
            servicer, server
        ),
        side_servers=side_servers,
        on_drain=on_drain,
        on_close=[clients.close, store.close],
    )


def main(argv: Sequence[str] | None = None) -> int:
    return serve("controller", build_spec, argv)
