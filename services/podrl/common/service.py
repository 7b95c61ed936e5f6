"""The process lifecycle every podrl service shares.

start: parse ``--config``, validate the run config once and read the run secret (a bad config
or a missing secret: exit 2), set up logs, start the gRPC server (with ``grpc.health.v1`` for ""
and the service's own name, reflection, bounded message sizes, metrics, and the run's
authentication on every other RPC: ``podrl.common.auth``), start side servers (Prometheus,
REST), register with the controller. A port that cannot be bound stops the service with exit 2
and a message naming the port's config field.

stop (SIGTERM or SIGINT): health → NOT_SERVING, tell the controller we are draining, let
in-flight RPCs finish within ``grpc.shutdown_grace_seconds``, stop side servers, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Gauge, start_http_server

import podrl
from podrl.common.auth import (
    AuthServerInterceptor,
    CallerCredentials,
    MetricsInterceptor,
    load_run_secret,
    worker_id_problem,
)
from podrl.common.grpc_options import server_options
from podrl.common.logs import setup_logging
from podrl.common.membership import MembershipClient
from podrl.config import ConfigError, RunConfig, load_config
from podrl.config.base import ServiceSection
from podrl.v1 import common_pb2, controller_pb2

log = logging.getLogger(__name__)

SERVICE_UP = Gauge(
    "podrl_service_serving", "1 while the service reports SERVING.", ["service", "worker_id"]
)


class SideServer(Protocol):
    """Something that runs beside the gRPC server (a metrics or REST endpoint)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...


def port_in_use_error(field_name: str, host: str, port: int, err: OSError | None) -> ConfigError:
    """The error a service stops with (exit 2) when ``host:port`` of ``field_name`` (e.g.
    ``grader.metrics_port``) cannot be bound."""
    env_name = "PODRL_" + field_name.upper().replace(".", "__")
    cause = f" ({err.strerror or err})" if err is not None else " (port in use or host not local)"
    return ConfigError(
        f"{field_name}: cannot listen on {host}:{port}{cause}; choose another port with {env_name}"
    )


class PrometheusServer:
    """prometheus_client's own HTTP exporter on ``port`` (0 = disabled)."""

    def __init__(self, host: str, port: int, field_name: str = "metrics_port") -> None:
        self._host, self._port, self._field = host, port, field_name
        self._server = None

    def start(self) -> None:
        if self._port:
            try:
                self._server, _ = start_http_server(self._port, addr=self._host)
            except OSError as err:
                raise port_in_use_error(self._field, self._host, self._port, err) from None
            log.info("metrics on http://%s:%d/metrics", self._host, self._port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


@dataclass
class ServiceSpec:
    """What distinguishes one service from another; everything else is shared."""

    name: str
    """Short name: controller, generator, grader or trainer."""
    grpc_service: str
    """Fully qualified gRPC service name (health checks accept it)."""
    section: ServiceSection
    add_servicers: Callable[[grpc.Server], None]
    component: int | None = None
    """controller_pb2.Component to register as; None: not registered (the controller itself,
    and the environment service, which the controller does not track yet)."""
    details: dict[str, str] = field(default_factory=dict)
    side_servers: list[SideServer] = field(default_factory=list)
    policy_version: Callable[[], int] | None = None
    """What the process serves or trains now; reported in heartbeats (status pages)."""
    on_drain: list[Callable[[], None]] = field(default_factory=list)
    """Run right after health turns NOT_SERVING, while the gRPC server still answers (finish or
    stop long-running work that needs other services, e.g. the controller's loop)."""
    on_close: list[Callable[[], None]] = field(default_factory=list)
    """Run after the gRPC server stopped (release engines, shared memory, ...)."""
    until_ready: Callable[[], None] | None = None
    """Blocks until the service can do its work (e.g. its engine loaded). Runs after the gRPC
    server started; health answers NOT_SERVING until it returns, then SERVING. If it raises,
    the service shuts down (on_close hooks run) and the error propagates."""


class ServiceProcess:
    """Runs one ServiceSpec until a stop signal; see the module docstring.

    The run secret comes from ``env`` (default: this process's environment); without one the
    constructor raises ConfigError, unless the config says ``auth.disabled``.
    """

    def __init__(
        self, spec: ServiceSpec, config: RunConfig, env: Mapping[str, str] | None = None
    ) -> None:
        self.spec = spec
        self.config = config
        self.stopping = threading.Event()
        self.secret = load_run_secret(config.auth, env)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=config.grpc.max_workers, thread_name_prefix=f"{spec.name}-rpc"
            ),
            # Metrics first: refused calls are counted too (grpc_code UNAUTHENTICATED, ...).
            interceptors=[MetricsInterceptor(), AuthServerInterceptor(self.secret)],
            options=server_options(config.grpc),
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        spec.add_servicers(self.server)
        reflection.enable_server_reflection(
            (
                spec.grpc_service,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.membership: MembershipClient | None = None

    def _set_serving(self, status: int) -> None:
        for name in ("", self.spec.grpc_service):
            self.health.set(name, status)

    def start(self) -> None:
        section = self.spec.section
        bind = f"{section.bind_host}:{section.grpc_port}"
        try:
            bound = self.server.add_insecure_port(bind)
        except RuntimeError:
            bound = 0
        if not bound:
            raise port_in_use_error(
                f"{self.spec.name}.grpc_port", section.bind_host, section.grpc_port, None
            )
        started: list[SideServer] = []
        try:
            for side in self.spec.side_servers:
                side.start()
                started.append(side)
        except BaseException:  # e.g. its port in use: stop the ones already running, then exit
            for side in reversed(started):
                side.stop()
            self.server.stop(grace=None)
            raise
        if self.spec.until_ready is not None:
            self._set_serving(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.start()
        if self.spec.until_ready is not None:
            try:
                self.spec.until_ready()
            except BaseException:
                self.shutdown("failed to become ready")
                raise
        self._set_serving(health_pb2.HealthCheckResponse.SERVING)
        SERVICE_UP.labels(self.spec.name, self.config.worker_id).set(1)
        log.info("%s serving gRPC on %s", self.spec.name, bind)
        if self.spec.component is not None:
            info = common_pb2.ServiceInfo(
                service=self.spec.grpc_service,
                version=podrl.__version__,
                worker_id=self.config.worker_id,
                details=self.spec.details,
            )
            credentials = None
            if self.secret is not None:
                credentials = CallerCredentials(self.secret, self.spec.name, self.config.worker_id)
            self.membership = MembershipClient(
                self.config,
                self.spec.component,
                section.address,
                info,
                policy_version=self.spec.policy_version,
                credentials=credentials,
            )
            self.membership.start()

    def shutdown(self, reason: str = "SIGTERM") -> None:
        log.info("%s shutting down (%s): NOT_SERVING, draining", self.spec.name, reason)
        self.health.enter_graceful_shutdown()
        SERVICE_UP.labels(self.spec.name, self.config.worker_id).set(0)
        if self.membership is not None:
            self.membership.drain(reason)
        for hook in self.spec.on_drain:
            try:
                hook()
            except Exception:  # draining must go on
                log.exception("drain hook failed")
        self.server.stop(grace=self.config.grpc.shutdown_grace_seconds).wait()
        if self.membership is not None:
            self.membership.close()
        for side in reversed(self.spec.side_servers):
            side.stop()
        for hook in self.spec.on_close:
            try:
                hook()
            except Exception:  # a failing cleanup must not block the others
                log.exception("cleanup hook failed")
        log.info("%s stopped", self.spec.name)

    def run_until_signalled(self) -> int:
        received: list[str] = []

        def on_signal(signum: int, _frame: object) -> None:
            received.append(signal.Signals(signum).name)
            self.stopping.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        # Poll: a signal that lands on a gRPC/uvicorn thread does not wake a main thread blocked
        # in a lock wait, and Python runs handlers only on the main thread.
        while not self.stopping.wait(0.25):
            pass
        self.shutdown(received[0] if received else "stop requested")
        return 0


_WORKER_COMPONENTS = {
    "generator": controller_pb2.COMPONENT_GENERATOR,
    "grader": controller_pb2.COMPONENT_GRADER,
    "trainer": controller_pb2.COMPONENT_TRAINER,
}


def worker_spec(
    name: str,
    config: RunConfig,
    servicer: object,
    add_servicer: Callable[[object, grpc.Server], None],
    on_close: Sequence[Callable[[], None]] = (),
    until_ready: Callable[[], None] | None = None,
) -> ServiceSpec:
    """The spec of a worker-pod service: registers with the controller, exports Prometheus."""
    section = getattr(config, name)
    return ServiceSpec(
        name=name,
        grpc_service=f"podrl.v1.{name.capitalize()}",
        section=section,
        component=_WORKER_COMPONENTS[name],
        add_servicers=lambda server: add_servicer(servicer, server),
        side_servers=[
            PrometheusServer(section.bind_host, section.metrics_port, f"{name}.metrics_port")
        ],
        on_close=list(on_close),
        until_ready=until_ready,
    )


def use_compile_cache(config: RunConfig, name: str) -> None:
    """Point this process's compile caches into ``compile_cache_dir``, so compiled kernels and
    graphs persist across runs; its ranks and vLLM's processes inherit the variables. A folder
    it cannot write (e.g. a volume an older image has no mount point for, owned by root) leaves
    the caches where torch and vLLM put them by default: a warning, not a failed start."""
    wanted = config.compile_cache_env()
    try:
        for folder in wanted.values():
            os.makedirs(folder, exist_ok=True)
            if not os.access(folder, os.W_OK | os.X_OK):
                raise PermissionError(f"{folder} is not writable by this user")
    except OSError as err:
        message = (
            f"compile_cache_dir: {err}; the {name}'s compile caches stay in their default "
            "folders and do not outlive this process (make the folder writable by this user)"
        )
        log.warning("%s", message)
        print(f"podrl-{name}: warning: {message}", file=sys.stderr)
        return
    os.environ.update(wanted)


def parse_service_args(name: str, argv: Sequence[str] | None) -> RunConfig:
    """``podrl-<name> [--config FILE]`` → validated RunConfig (exits 2 on a bad config, or
    when the run secret is missing or unreadable: checked here, before any slow start-up)."""
    parser = argparse.ArgumentParser(
        prog=f"podrl-{name}",
        description=f"Run the podrl {name} service. Every config field can also be set as "
        "PODRL_<SECTION>__<FIELD> in the environment.",
    )
    parser.add_argument("--config", help="run config YAML (default: $PODRL_CONFIG or built-ins)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        problem = worker_id_problem(config.worker_id)
        if problem:  # the controller would refuse every registration under it
            raise ConfigError(f"worker_id (PODRL_WORKER_ID) {problem}")
        load_run_secret(config.auth, os.environ)
        if name in ("trainer", "generator"):
            use_compile_cache(config, name)
        return config
    except ConfigError as err:
        print(f"podrl-{name}: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def serve(
    name: str, build_spec: Callable[[RunConfig], ServiceSpec], argv: Sequence[str] | None
) -> int:
    """Entry point body shared by every ``podrl-<service>`` command."""
    config = parse_service_args(name, argv)
    setup_logging(config.log, name, config.worker_id)
    try:
        process = ServiceProcess(build_spec(config), config)
        return process.run_until_signalled()
    except ConfigError as err:
        log.error("%s", err)
        print(f"podrl-{name}: {err}", file=sys.stderr)
        return 2
