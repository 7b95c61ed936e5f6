"""``podrl-controller``: gRPC membership service, REST API and (when configured) the GRPO loop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import uvicorn

from podrl.common.auth import CONTROLLER, CallerCredentials, load_run_secret
from podrl.common.service import ServiceSpec, port_in_use_error, serve
from podrl.config import RunConfig
from podrl.controller.pods.clients import WorkerClients
from podrl.controller.pods.kube_watch import KubeWatch, KubeWatchConfig
from podrl.controller.pods.membership import MemberRegistry
from podrl.controller.pods.roster import PodRoster
from podrl.controller.pods.scaling import KubernetesScaler, LocalScaler, ReplicaScaler
from podrl.controller.records.run_store import RunStore
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.servicer import ControllerServicer
from podrl.controller.service.status import RunState
from podrl.controller.step.loop import GrpoLoop
from podrl.tasks import build_task_source
from podrl.tasks.prompt_bounds import check_prompts_fit
from podrl.v1 import controller_pb2_grpc


class RestServer:
    """uvicorn in a background thread; the main thread owns signals (see common.service).

    The socket is bound here, in start(), so that a port in use stops the controller (exit 2,
    naming ``controller.http_port``): uvicorn itself would only log it and end its thread, and
    the controller would run on without its REST API. start() returns once uvicorn serves.
    """

    def __init__(
        self, app: object, host: str, port: int, startup_timeout_seconds: float = 60.0
    ) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False)
        self._host, self._port = host, port
        self._startup_timeout = startup_timeout_seconds
        self._server = uvicorn.Server(config)
        self._socket: socket.socket | None = None
        self._thread = threading.Thread(target=self._serve, name="rest", daemon=True)

    def _bind(self) -> socket.socket:
        try:
            family, kind, proto, _, address = socket.getaddrinfo(
                self._host, self._port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            )[0]
            sock = socket.socket(family, kind, proto)
        except OSError as err:
            raise port_in_use_error("controller.http_port", self._host, self._port, err) from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # not SO_REUSEPORT
            sock.bind(address)
        except OSError as err:
            sock.close()
            raise port_in_use_error("controller.http_port", self._host, self._port, err) from None
        return sock

    def _serve(self) -> None:
        assert self._socket is not None
        self._server.run(sockets=[self._socket])

    def start(self) -> None:
        self._socket = self._bind()
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the controller's REST server on {self._host}:{self._port} did not start "
                    "(see the log above); the controller does not run without it"
                )
            time.sleep(0.02)

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


class KubeWatchServer:
    """The Kubernetes watch as a side server: started with the controller, stopped with it."""

    def __init__(self, watch: KubeWatch) -> None:
        self.watch = watch

    def start(self) -> None:
        self.watch.start()

    def stop(self) -> None:
        self.watch.stop()


def build_scaling(
    config: RunConfig, registry: MemberRegistry
) -> tuple[PodRoster, ReplicaScaler, KubeWatch | None]:
    """In a cluster (``KubeWatchConfig.build()``): the watch of the worker StatefulSet and its
    pods tells the roster the desired count and the terminating pods, and the scaler patches
    ``statefulsets/scale``. Outside one: the count is held here (``controller.worker_pods``
    at start) and the local launcher follows it; the roster runs on membership alone."""
    kube = KubeWatchConfig.build()
    if kube is None:
        scaler: ReplicaScaler = LocalScaler(config.controller.worker_pods)
        return PodRoster(registry, desired_replicas=scaler.desired_replicas), scaler, None
    watch = KubeWatch(kube)
    roster = PodRoster(
        registry,
        desired_replicas=lambda: watch.view().desired_replicas,
        terminating=lambda: watch.view().terminating,
    )
    return roster, KubernetesScaler(kube), watch


def build_spec(config: RunConfig) -> ServiceSpec:
    section = config.controller
    registry = MemberRegistry(section.heartbeat_timeout_seconds)
    state = RunState(config.name, registry, section.min_worker_pods, config.loop.steps)
    roster, scaler, watch = build_scaling(config, registry)
    state.roster = roster
    store = RunStore(config.run_dir / "controller.sqlite")
    servicer = ControllerServicer(state, section.heartbeat_interval_seconds)
    side_servers: list = [] if watch is None else [KubeWatchServer(watch)]
    # One secret for both: the REST API's changes and the controller's own gRPC calls.
    secret = load_run_secret(config.auth)
    rest = build_rest_app(
        state,
        store,
        scaler,
        section.max_worker_pods,
        secret=secret,
        auth_disabled=config.auth.disabled,
    )
    side_servers.append(RestServer(rest, section.bind_host, section.http_port))
    clients = WorkerClients(
        config.grpc,
        None if secret is None else CallerCredentials(secret, CONTROLLER, config.worker_id),
    )
    on_drain = []
    if config.loop.steps:
        check_prompts_fit(config)  # a prompt too long for the model: exit 2, at start
        source = build_task_source(config.tasks)  # a bad task config fails here, at start
        runner = LoopRunner(GrpoLoop(config, state, store, clients, source, roster))
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
