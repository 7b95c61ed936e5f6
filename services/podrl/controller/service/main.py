"""``podrl-controller``: gRPC membership service, REST API and (when configured) the GRPO loop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import uvicorn

from podrl.common.auth import CONTROLLER, CallerCredentials, load_run_secret
from podrl.common.service import ServiceSpec, port_in_use_error, serve
from podrl.config import RunConfig
from podrl.controller.pods.kube_watch import KubeWatch, KubeWatchConfig
from podrl.controller.pods.scaling import ReplicaScaler, build_scaler
from podrl.controller.pods.table import PodTable
from podrl.controller.records.checkpointing import RunCheckpoints
from podrl.controller.records.evaluation import Evaluator
from podrl.controller.records.recorder import RunStore, StepRecorder
from podrl.controller.rollout.gate import GeneratorGate
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.servicer import ControllerServicer
from podrl.controller.service.status import RolloutView, RunState
from podrl.controller.step.async_steps import AsyncSteps
from podrl.controller.step.loop import GrpoLoop, StepDriver, StepParts, SyncSteps
from podrl.controller.step.pod_calls import TrainPhase, WeightSync, WorkerClients, WorkerPhases
from podrl.tasks import TaskSource, build_task_source
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


def build_loop(
    config: RunConfig,
    state: RunState,
    store: RunStore,
    clients: WorkerClients,
    source: TaskSource,
    table: PodTable,
    stop: threading.Event,
    train_backoff_seconds: float = 2.0,
) -> GrpoLoop:
    """The loop and everything it drives, each part given what it uses when it is built.
    ``stop`` ends the run (the step in flight finishes, its retries end early);
    ``train_backoff_seconds``: the wait before a Train is re-sent (times the send's number)."""
    pool = ThreadPoolExecutor(
        max_workers=config.controller.loop_call_threads, thread_name_prefix="loop-rpc"
    )
    gate = GeneratorGate(config.loop.stop_poll_seconds)
    asynchronous = config.loop.mode == "async"
    phases = WorkerPhases(clients, pool, table)
    if any(task.environment is not None for task in config.tasks.definitions):
        # Imported only here: a single-turn run's step runs no episode code.
        from podrl.controller.rollout.episode_figures import EpisodeFigures
        from podrl.controller.rollout.episodes import EpisodePhases

        figures = EpisodeFigures(config.controller.episode_view_chars)
        state.follow_episodes(figures.view, figures.latest)
        phases = EpisodePhases(
            clients, pool, table, config.tasks.definitions, config.environments, figures
        )
    weights = WeightSync(
        clients,
        pool,
        stop,
        # async mode: each ApplyWeights waits for the producer's batch to end (none in flight)
        applying=gate.loop if asynchronous else nullcontext,
        in_flight=config.loop.weight_apply == "in_flight",
    )
    train_phase = TrainPhase(
        clients,
        config.loop.max_step_attempts,
        stop,
        backoff_seconds=train_backoff_seconds,
        on_lost=table.trainer_lost,  # a trainer lost mid-Train leaves the admitted pods
    )
    recorder = StepRecorder(config, state, store)
    parts = StepParts(
        config,
        state,
        store,
        source,
        table,
        phases,
        train_phase,
        weights,
        recorder,
        gate,
        pool,
        stop,
    )
    driver: StepDriver
    if asynchronous:
        driver = AsyncSteps(parts)
        state.follow_loop(lambda: parts.phase, buffer_fill=driver.producer.fill)
    else:
        driver = SyncSteps(parts)
        state.follow_loop(lambda: parts.phase)
    checkpoints = RunCheckpoints(
        config, state, store, clients, source, recorder, table, train_phase
    )
    return GrpoLoop(parts, driver, checkpoints, Evaluator(config))


class LoopRunner:
    """Runs the GRPO loop in a thread. stop() lets the step in flight finish (its retries end
    early), then the loop checkpoints and ends; stop() returns when it has."""

    def __init__(self, loop: GrpoLoop, stop: threading.Event) -> None:
        self._stop = stop
        self._thread = threading.Thread(target=loop.run, name="grpo-loop")

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


def build_scaling(config: RunConfig, table: PodTable) -> tuple[ReplicaScaler, KubeWatch | None]:
    """In a cluster (``KubeWatchConfig.build()``): the watch of the worker StatefulSet and its
    pods tells the pod table the desired count and the terminating pods, and the scaler patches
    ``statefulsets/scale``. Outside one: the count is held here (``controller.worker_pods``
    at start) and the local launcher follows it; the table runs on membership alone."""
    kube = KubeWatchConfig.build()
    scaler = build_scaler(kube, config.controller.worker_pods)
    if kube is None:
        table.follow_cluster(scaler.desired_replicas)
        return scaler, None
    watch = KubeWatch(kube)
    table.follow_cluster(
        desired_replicas=lambda: watch.view().desired_replicas,
        terminating=lambda: watch.view().terminating,
    )
    return scaler, watch


def build_spec(config: RunConfig) -> ServiceSpec:
    section = config.controller
    table = PodTable(section.heartbeat_timeout_seconds)
    scaler, watch = build_scaling(config, table)
    state = RunState(
        config.name,
        table,
        section.min_worker_pods,
        config.loop.steps,
        rollout=RolloutView.of(config.loop),
    )
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
        stop = threading.Event()
        runner = LoopRunner(build_loop(config, state, store, clients, source, table, stop), stop)
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
