"""Worker pods plus a controller as local processes on loopback (what `podrl up` runs).

A local *pod* ``local-N`` is a generator, a grader and a trainer process with worker id
``local-N``, as a StatefulSet pod in a cluster is. The launcher keeps the number of pods at the
desired count, as the StatefulSet controller does: ``podrl up --pods N`` starts N; a
``PUT /v1/workers/replicas`` (or ``podrl scale``) changes the controller's desired count, and
:meth:`LocalCluster.supervise` (called about once a second by ``podrl up``/``podrl run``)
follows it: new ordinals are started, and pods with an ordinal at or above the count are
drained with SIGTERM, highest first. A pod's process that dies is started again (as kubelet
restarts a container), up to :data:`MAX_RESTARTS` times; a configuration error (exit 2) is not
retried.

When more than one pod may run (``controller.max_worker_pods`` > 1) a torchft Lighthouse
(``podrl-lighthouse``) runs beside the controller and every trainer is a replica group of it;
with ``max_worker_pods: 1`` there is none and the trainer trains alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from podrl.cli.probes import grpc_health, http_ready
from podrl.common.auth import CallerCredentials
from podrl.common.processes import die_with_parent, free_ports
from podrl.config import RunConfig
from podrl.config.auth import SECRET_FILE_ENV, SECRET_VALUE_ENV
from podrl.generator.engine_processes import reap_dead_engine_segments, reap_dead_socket_dirs
from podrl.models.folders import check_model_folders

log = logging.getLogger(__name__)

SERVICES = ("controller", "generator", "grader", "trainer")
POD_SERVICES = ("generator", "grader", "trainer")
#: gRPC service names that are not ``podrl.v1.<Name>`` of the process's name.
GRPC_SERVICES = {"environments": "podrl.v1.Environment"}


def pod_services(config: RunConfig) -> tuple[str, ...]:
    """The processes of a local pod: the environment service too when a task names an
    environment (the step plays that task's episodes on it)."""
    if any(task.environment is not None for task in config.tasks.definitions):
        return (*POD_SERVICES, "environments")
    return POD_SERVICES


WORKER_ID = "local-0"
#: A pod's process is started again at most this many times in a run.
MAX_RESTARTS = 5
#: Exit code of a service refused at start (bad config): starting it again cannot help.
CONFIG_ERROR_EXIT = 2
#: The pod's weights key file (podrl.weights.protocol): only its trainer and generator get it.
WEIGHTS_KEY_FILE_ENV = "PODRL_WEIGHTS_KEY_FILE"


def pod_name(ordinal: int) -> str:
    return f"local-{ordinal}"


def _write_private(path: Path, text: str) -> None:
    """``text`` in ``path``, mode 0600 from its creation on (written to a new file and renamed
    over the old one, so no reader sees it half written)."""
    fresh = path.with_name(f".{path.name}.{os.getpid()}")
    fresh.unlink(missing_ok=True)
    descriptor = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as out:
        out.write(text + "\n")
    os.replace(fresh, path)


def kill_process_group(child: Child) -> None:
    """SIGKILL what is left of ``child``'s process group once the child itself has ended: each
    service leads a group of its own (``start_new_session``), which the processes it starts
    (vLLM's engine core and workers) inherit, so nothing of a killed service lives on."""
    if child.process.poll() is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, signal.SIGKILL)


def ready_line(times: dict[str, float]) -> str:
    """``ready after: controller 2.1 s, generator 41.0 s, ...``: how long each service took
    from its start to serving (a generator's engine load and compile, a trainer's model)."""
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in times.items())
    return f"ready after: {parts}"


class ChildExitedError(RuntimeError):
    """A service process ended while it should be running."""

    def __init__(self, child: Child) -> None:
        self.child = child
        super().__init__(f"{child.name} (pid {child.process.pid}) {child.exit_description()}")


@dataclass
class Child:
    name: str
    """``controller``, ``lighthouse``, or a pod's service: ``generator`` etc. for local-0,
    ``generator@local-1`` for the others."""
    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_address: str
    service: str = ""
    """The service it runs (its name for the controller and local-0)."""
    ordinal: int | None = None
    """The pod it belongs to; None for the controller and the Lighthouse."""
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)
    """When the launcher started the process (monotonic clock)."""
    ready_seconds: float | None = None
    """Seconds from its start to the first SERVING health answer the launcher saw."""

    @property
    def grpc_service(self) -> str:
        name = self.service or self.name
        return GRPC_SERVICES.get(name, f"podrl.v1.{name.capitalize()}")

    def exit_description(self) -> str:
        code = self.process.returncode
        if code is None:
            return "is running"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


@dataclass
class LocalPod:
    ordinal: int
    ports: dict[str, int]
    """generator, generator_metrics, grader, grader_metrics, trainer."""
    children: dict[str, Child] = field(default_factory=dict)
    draining: bool = False

    @property
    def name(self) -> str:
        return pod_name(self.ordinal)


class LocalCluster:
    """Starts the controller, the Lighthouse and ``pods`` worker pods with free ports, keeps
    the pods at the desired count, stops them all."""

    def __init__(
        self,
        config: RunConfig,
        config_path: str | None,
        pods: int | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        # A configured model folder without a model stops the run here (a ConfigError, so
        # `podrl up`/`run` exit 2 naming the field), before any service could write a random
        # model in its place.
        check_model_folders(config)
        self.config = config
        self.config_path = config_path
        self.on_event = on_event or (lambda message: log.info("%s", message))
        host = "127.0.0.1"
        self.host = host
        self.replicated = config.controller.max_worker_pods > 1
        initial = config.controller.worker_pods if pods is None else pods
        if not 1 <= initial <= config.controller.max_worker_pods:
            raise ValueError(
                f"--pods {initial}: between 1 and controller.max_worker_pods "
                f"({config.controller.max_worker_pods}); raise max_worker_pods for more"
            )
        self.pod_services = pod_services(config)
        if "environments" in self.pod_services and initial > 1:
            # The controller finds a pod's environment service at environments.grpc_port on
            # its generator's host: one per host (a second local pod's would find it in use).
            raise ValueError(
                f"--pods {initial}: a task names an environment, and locally only one pod can "
                "run the environment service (at environments.grpc_port); start one pod"
            )
        controller_grpc, http, lighthouse = free_ports(3, host)
        self.controller_ports = {"grpc": controller_grpc, "http": http, "lighthouse": lighthouse}
        self.overrides = {
            "PODRL_WORKER_ID": WORKER_ID,
            # The launcher resolved the run dir; children must agree on it.
            "PODRL_RUN_DIR": str(config.run_dir),
            "PODRL_CONTROLLER__GRPC_PORT": str(controller_grpc),
            "PODRL_CONTROLLER__HTTP_PORT": str(http),
            "PODRL_TRAINER__METRICS_PORT": "0",
        }
        if self.replicated:
            self.overrides["PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS"] = (
                f"{host}:{lighthouse}"
            )
        for name in (*SERVICES, "environments"):
            self.overrides[f"PODRL_{name.upper()}__BIND_HOST"] = host
            self.overrides[f"PODRL_{name.upper()}__ADVERTISE_HOST"] = host
        self.log_dir = config.run_dir / "logs"
        # The run secret: a new one at every start, readable by this user only (docs/security.md).
        self.secret_file = config.run_dir / "run-secret"
        if not config.auth.disabled:
            self.overrides[SECRET_FILE_ENV] = str(self.secret_file)
        self.controller: Child | None = None
        self.lighthouse: Child | None = None
        self.pods: dict[int, LocalPod] = {}
        self._pod_ports: dict[int, dict[str, int]] = {}  # an ordinal keeps its ports
        self._lock = threading.RLock()
        self._desired = initial
        """The controller's desired pod count as last read (the controller owns it; this is
        the count it was started with until then)."""
        self.http = httpx.Client(timeout=5.0)
        """One REST client for the controller's API: ``httpx.get`` builds a client, and its
        TLS context, per call (tens of milliseconds of CPU, twice a second in `podrl run`)."""

    # -- where things are ------------------------------------------------------------------------
    @property
    def ports(self) -> list[int]:
        """The first pod's layout of old: controller gRPC, REST, then local-0's ports."""
        pod = self._ports_of(0)
        return [
            self.controller_ports["grpc"],
            self.controller_ports["http"],
            pod["generator"],
            pod["generator_metrics"],
            pod["grader"],
            pod["grader_metrics"],
            pod["trainer"],
        ]

    @property
    def rest_url(self) -> str:
        return f"http://{self.host}:{self.controller_ports['http']}"

    @property
    def children(self) -> list[Child]:
        """The controller and every pod's processes (running or draining), pods by ordinal."""
        with self._lock:
            pods = [
                child
                for ordinal in sorted(self.pods)
                for child in self.pods[ordinal].children.values()
            ]
            return ([self.controller] if self.controller else []) + pods

    def urls(self) -> dict[str, str]:
        urls = {
            "controller REST": self.rest_url,
            "dashboard": f"{self.rest_url}/dashboard",
            "API docs": f"{self.rest_url}/docs",
            "controller gRPC": f"{self.host}:{self.controller_ports['grpc']}",
        }
        if self.replicated:
            urls["lighthouse"] = f"{self.host}:{self.controller_ports['lighthouse']}"
        with self._lock:
            ordinals = sorted(self.pods)
        for ordinal in ordinals:
            ports = self._ports_of(ordinal)
            prefix = "" if ordinal == 0 else f"{pod_name(ordinal)} "
            urls[f"{prefix}generator gRPC"] = f"{self.host}:{ports['generator']}"
            urls[f"{prefix}generator metrics"] = (
                f"http://{self.host}:{ports['generator_metrics']}/metrics"
            )
            urls[f"{prefix}grader gRPC"] = f"{self.host}:{ports['grader']}"
            urls[f"{prefix}grader metrics"] = (
                f"http://{self.host}:{ports['grader_metrics']}/metrics"
            )
            urls[f"{prefix}trainer gRPC"] = f"{self.host}:{ports['trainer']}"
        return urls

    def child(self, name: str) -> Child:
        """By name: ``controller``, ``lighthouse``, ``trainer`` (local-0), ``trainer@local-2``."""
        if name == "lighthouse" and self.lighthouse is not None:
            return self.lighthouse
        return next(c for c in self.children if c.name == name)

    def _ports_of(self, ordinal: int) -> dict[str, int]:
        with self._lock:
            if ordinal not in self._pod_ports:
                names = ("generator", "generator_metrics", "grader", "grader_metrics", "trainer")
                self._pod_ports[ordinal] = dict(zip(names, free_ports(5, self.host), strict=True))
            return self._pod_ports[ordinal]

    # -- starting processes ----------------------------------------------------------------------
    def _popen(
        self, cmd: list[str], env: dict[str, str], log_path: Path
    ) -> subprocess.Popen[bytes]:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            # The launcher's own secret variables never reach the children: they use its file.
            inherited = {k: v for k, v in os.environ.items() if k != SECRET_VALUE_ENV}
            return subprocess.Popen(
                cmd,
                env={**inherited, **self.overrides, **env},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops in order
                preexec_fn=die_with_parent,
            )

    def _config_args(self) -> list[str]:
        return ["--config", self.config_path] if self.config_path else []

    def _spawn_controller(self) -> Child:
        # A restarted controller starts from the count the launcher follows now.
        env = {"PODRL_CONTROLLER__WORKER_PODS": str(self.desired_replicas())}
        cmd = [sys.executable, "-m", "podrl.controller", *self._config_args()]
        process = self._popen(cmd, env, self.log_dir / "controller.log")
        return Child(
            "controller", process, self.log_dir / "controller.log",
            f"{self.host}:{self.controller_ports['grpc']}", "controller",
        )  # fmt: skip

    def _spawn_lighthouse(self) -> Child:
        address = f"{self.host}:{self.controller_ports['lighthouse']}"
        cmd = [
            sys.executable, "-m", "podrl.trainer.lighthouse", *self._config_args(),
            "--bind", address,
        ]  # fmt: skip
        log_path = self.log_dir / "lighthouse.log"
        return Child("lighthouse", self._popen(cmd, {}, log_path), log_path, address, "lighthouse")

    def _spawn_service(self, ordinal: int, service: str, restarts: int = 0) -> Child:
        ports = self._ports_of(ordinal)
        env = {"PODRL_WORKER_ID": pod_name(ordinal)}
        for name in ("generator", "grader"):
            env[f"PODRL_{name.upper()}__GRPC_PORT"] = str(ports[name])
            env[f"PODRL_{name.upper()}__METRICS_PORT"] = str(ports[f"{name}_metrics"])
        env["PODRL_TRAINER__GRPC_PORT"] = str(ports["trainer"])
        if service in ("trainer", "generator"):
            env[WEIGHTS_KEY_FILE_ENV] = str(self.weights_key_file(ordinal))
        # The environment service listens where the controller looks for it (its metrics
        # port off: one fixed port per host is enough to collide with).
        env["PODRL_ENVIRONMENTS__GRPC_PORT"] = str(self.config.environments.grpc_port)
        env["PODRL_ENVIRONMENTS__METRICS_PORT"] = "0"
        address = (
            f"{self.host}:{self.config.environments.grpc_port}"
            if service == "environments"
            else f"{self.host}:{ports[service]}"
        )
        folder = self.log_dir if ordinal == 0 else self.log_dir / pod_name(ordinal)
        log_path = folder / f"{service}.log"
        cmd = [sys.executable, "-m", f"podrl.{service}", *self._config_args()]
        name = service if ordinal == 0 else f"{service}@{pod_name(ordinal)}"
        return Child(
            name,
            self._popen(cmd, env, log_path),
            log_path,
            address,
            service,
            ordinal,
            restarts,
        )

    def weights_key_file(self, ordinal: int) -> Path:
        return self.config.run_dir / "keys" / f"{pod_name(ordinal)}.weights-key"

    def _start_pod(self, ordinal: int) -> LocalPod:
        # A new key for every pod start; a restarted process of the pod keeps the pod's key.
        key_file = self.weights_key_file(ordinal)
        key_file.parent.mkdir(mode=0o700, exist_ok=True)
        _write_private(key_file, secrets.token_hex(32))
        pod = LocalPod(ordinal, self._ports_of(ordinal))
        pod.children = {s: self._spawn_service(ordinal, s) for s in self.pod_services}
        self.pods[ordinal] = pod
        return pod

    def _write_secret(self) -> None:
        _write_private(self.secret_file, secrets.token_hex(32))

    def credentials(self, role: str = "controller") -> CallerCredentials | None:
        """Credentials of ``role`` for calls into this cluster (tools, tests); None when the
        run's auth is disabled."""
        return CallerCredentials.for_role(
            role, WORKER_ID, self.config.auth, {SECRET_FILE_ENV: str(self.secret_file)}
        )

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if not self.config.auth.disabled:
            self._write_secret()
        with self._lock:
            if self.replicated:
                self.lighthouse = self._spawn_lighthouse()
            self.controller = self._spawn_controller()
            for ordinal in range(self.desired_replicas()):
                self._start_pod(ordinal)

    def restart(self, name: str) -> Child:
        """Start ``name`` again on the same ports (after it died or was killed)."""
        with self._lock:
            old = self.child(name)
            if old.process.poll() is None:
                raise RuntimeError(f"{name} (pid {old.process.pid}) is still running")
            if old is self.controller:
                self.controller = self._spawn_controller()
                return self.controller
            if old is self.lighthouse:
                self.lighthouse = self._spawn_lighthouse()
                return self.lighthouse
            assert old.ordinal is not None
            new = self._spawn_service(old.ordinal, old.service, old.restarts + 1)
            self.pods[old.ordinal].children[old.service] = new
            return new

    # -- keeping it at the desired count ---------------------------------------------------------
    def desired_replicas(self) -> int:
        """The controller's desired pod count, as last read by :meth:`follow_desired`."""
        with self._lock:
            return self._desired

    def reconcile(self, replicas: int) -> None:
        """Start pods up to ``replicas``; SIGTERM (drain) those at or above it, highest ordinal
        first. Draining pods are reaped by supervise()."""
        with self._lock:
            for ordinal in sorted(self.pods, reverse=True):
                pod = self.pods[ordinal]
                if ordinal >= replicas and not pod.draining:
                    self.on_event(f"draining pod {pod.name} (desired pods: {replicas})")
                    pod.draining = True
                    for child in pod.children.values():
                        if child.process.poll() is None:
                            child.process.send_signal(signal.SIGTERM)
            for ordinal in range(replicas):
                if ordinal not in self.pods:  # a draining pod's ordinal waits for it to exit
                    self.on_event(f"starting pod {pod_name(ordinal)} (desired pods: {replicas})")
                    self._start_pod(ordinal)

    def follow_desired(self) -> None:
        """Read the controller's desired pod count and reconcile to it (best effort: a
        controller that does not answer leaves the count as it is)."""
        try:
            reply = self.http.get(f"{self.rest_url}/v1/workers/replicas", timeout=2.0)
            desired = reply.json().get("desired_replicas") if reply.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return
        if isinstance(desired, int) and desired >= 1:
            with self._lock:
                changed, self._desired = desired != self._desired, desired
                if changed:
                    self.reconcile(desired)

    def supervise(self) -> None:
        """One round of what the StatefulSet controller and kubelet do in a cluster: follow
        the desired count, reap drained pods (and start any ordinal they held that is wanted
        again), start a pod's dead process again. Raises ChildExitedError when the controller
        or the Lighthouse ended, or a pod's process cannot be started again."""
        for child in (self.controller, self.lighthouse):
            if child is not None and child.process.poll() is not None:
                raise ChildExitedError(child)
        self.follow_desired()
        with self._lock:
            for ordinal in sorted(self.pods):
                pod = self.pods[ordinal]
                if pod.draining:
                    if all(c.process.poll() is not None for c in pod.children.values()):
                        self.on_event(f"pod {pod.name} drained and stopped")
                        del self.pods[ordinal]
                    continue
                for service, child in list(pod.children.items()):
                    if child.process.poll() is None:
                        continue
                    code = child.process.returncode
                    if code == CONFIG_ERROR_EXIT or child.restarts >= MAX_RESTARTS:
                        raise ChildExitedError(child)
                    self.on_event(
                        f"{child.name} {child.exit_description()}; starting it again "
                        f"(restart {child.restarts + 1}/{MAX_RESTARTS})"
                    )
                    kill_process_group(child)  # what it started (vLLM's engine) goes too
                    pod.children[service] = self._spawn_service(
                        ordinal, service, child.restarts + 1
                    )
            self.reconcile(self._desired)

    def check_alive(self) -> None:
        """Raise ChildExitedError for any process that ended (draining pods excepted)."""
        for child in (self.controller, self.lighthouse):
            if child is not None and child.process.poll() is not None:
                raise ChildExitedError(child)
        with self._lock:
            pods = [pod for pod in self.pods.values() if not pod.draining]
        for pod in pods:
            for child in pod.children.values():
                if child.process.poll() is not None:
                    raise ChildExitedError(child)

    def wait_ready(self, timeout: float, should_stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait until every service is SERVING and the controller is ready.

        Returns False if ``should_stop()`` became true first;
        raises ChildExitedError or TimeoutError.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if should_stop():
                return False
            self.check_alive()
            for child in self.children:
                if child.ready_seconds is None and (
                    grpc_health(child.grpc_address, child.grpc_service, timeout=1.0) == "SERVING"
                ):
                    child.ready_seconds = time.monotonic() - child.started
            serving = all(child.ready_seconds is not None for child in self.children)
            if serving and http_ready(f"{self.rest_url}/readyz", timeout=1.0, client=self.http):
                return True
            time.sleep(0.2)
        raise TimeoutError(f"services not ready after {timeout:.0f}s; logs in {self.log_dir}")

    def ready_times(self) -> dict[str, float]:
        """Seconds each service took from its start to SERVING (those seen serving so far)."""
        return {c.name: c.ready_seconds for c in self.children if c.ready_seconds is not None}

    def stop(self, grace: float, controller_first: bool = False) -> None:
        """SIGTERM the workers, then the controller (so drain notices reach it), then the
        Lighthouse; SIGKILL stragglers. ``controller_first``: the controller ends a running
        loop (and checkpoints) while the workers still answer."""
        with self._lock:
            workers = [c for c in self.children if c is not self.controller]
        controller = [self.controller] if self.controller else []
        lighthouse = [self.lighthouse] if self.lighthouse else []
        groups = (controller, workers) if controller_first else (workers, controller)
        for group in (*groups, lighthouse):
            for child in group:
                if child.process.poll() is None:
                    child.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for child in group:
                try:
                    child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    child.process.kill()
                    child.process.wait()
                kill_process_group(child)
        # Shared memory and socket files of a vLLM engine whose generator was killed.
        reap_dead_engine_segments()
        reap_dead_socket_dirs()
