"""``podrl-controller``: gRPC membership service plus the REST API on one process."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import uvicorn

from podrl.common.service import ServiceSpec, serve
from podrl.config import RunConfig
from podrl.controller.membership import MemberRegistry
from podrl.controller.rest import build_rest_app
from podrl.controller.servicer import ControllerServicer
from podrl.controller.status import RunState
from podrl.v1 import controller_pb2_grpc


class RestServer:
    """uvicorn in a background thread; the main thread owns signals (see common.service)."""

    def __init__(self, state: RunState, host: str, port: int) -> None:
        config = uvicorn.Config(
            build_rest_app(state), host=host, port=port, log_config=None, access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="rest", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def build_spec(config: RunConfig) -> ServiceSpec:
    section = config.controller
    registry = MemberRegistry(section.heartbeat_timeout_seconds)
    state = RunState(config.name, registry, section.min_worker_pods)
    servicer = ControllerServicer(state, section.heartbeat_interval_seconds)
    return ServiceSpec(
        name="controller",
        grpc_service="podrl.v1.Controller",
        section=section,
        add_servicers=lambda server: controller_pb2_grpc.add_ControllerServicer_to_server(
            servicer, server
        ),
        side_servers=[RestServer(state, section.bind_host, section.http_port)],
    )


def main(argv: Sequence[str] | None = None) -> int:
    return serve("controller", build_spec, argv)
