"""One worker pod plus a controller as local processes on loopback (what `podrl up` runs)."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from podrl.cli.probes import grpc_health, http_ready
from podrl.common.auth import CallerCredentials
from podrl.common.processes import die_with_parent, free_ports
from podrl.config import RunConfig
from podrl.config.auth import SECRET_FILE_ENV, SECRET_VALUE_ENV

SERVICES = ("controller", "generator", "grader", "trainer")
WORKER_ID = "local-0"


class ChildExitedError(RuntimeError):
    """A service process ended while it should be running."""

    def __init__(self, child: Child) -> None:
        self.child = child
        super().__init__(f"{child.name} (pid {child.process.pid}) {child.exit_description()}")


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path
    grpc_address: str

    @property
    def grpc_service(self) -> str:
        return f"podrl.v1.{self.name.capitalize()}"

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


class LocalCluster:
    """Starts the four services with free ports, watches them, stops them all."""

    def __init__(self, config: RunConfig, config_path: str | None) -> None:
        self.config = config
        self.config_path = config_path
        self.children: list[Child] = []
        host = "127.0.0.1"
        ports = free_ports(7, host)
        self.overrides = {
            "PODRL_WORKER_ID": WORKER_ID,
            # The launcher resolved the run dir; children must agree on it.
            "PODRL_RUN_DIR": str(config.run_dir),
            "PODRL_CONTROLLER__GRPC_PORT": str(ports[0]),
            "PODRL_CONTROLLER__HTTP_PORT": str(ports[1]),
            "PODRL_GENERATOR__GRPC_PORT": str(ports[2]),
            "PODRL_GENERATOR__METRICS_PORT": str(ports[3]),
            "PODRL_GRADER__GRPC_PORT": str(ports[4]),
            "PODRL_GRADER__METRICS_PORT": str(ports[5]),
            "PODRL_TRAINER__GRPC_PORT": str(ports[6]),
            "PODRL_TRAINER__METRICS_PORT": "0",
        }
        for name in SERVICES:
            self.overrides[f"PODRL_{name.upper()}__BIND_HOST"] = host
            self.overrides[f"PODRL_{name.upper()}__ADVERTISE_HOST"] = host
        self.host = host
        self.ports = ports
        self.log_dir = config.run_dir / "logs"
        # The run secret: a new one at every start, readable by this user only (docs/security.md).
        self.secret_file = config.run_dir / "run-secret"
        if not config.auth.disabled:
            self.overrides[SECRET_FILE_ENV] = str(self.secret_file)

    @property
    def rest_url(self) -> str:
        return f"http://{self.host}:{self.ports[1]}"

    def urls(self) -> dict[str, str]:
        return {
            "controller REST": self.rest_url,
            "dashboard": f"{self.rest_url}/dashboard",
            "API docs": f"{self.rest_url}/docs",
            "controller gRPC": f"{self.host}:{self.ports[0]}",
            "generator gRPC": f"{self.host}:{self.ports[2]}",
            "generator metrics": f"http://{self.host}:{self.ports[3]}/metrics",
            "grader gRPC": f"{self.host}:{self.ports[4]}",
            "grader metrics": f"http://{self.host}:{self.ports[5]}/metrics",
            "trainer gRPC": f"{self.host}:{self.ports[6]}",
        }

    def _spawn(self, name: str) -> Child:
        grpc_ports = {"controller": 0, "generator": 2, "grader": 4, "trainer": 6}
        cmd = [sys.executable, "-m", f"podrl.{name}"]
        if self.config_path:
            cmd += ["--config", self.config_path]
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log_file:
            # The launcher's own secret variables never reach the children: they use its file.
            inherited = {k: v for k, v in os.environ.items() if k != SECRET_VALUE_ENV}
            process = subprocess.Popen(
                cmd,
                env={**inherited, **self.overrides},
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the launcher, which stops in order
                preexec_fn=die_with_parent,
            )
        return Child(name, process, log_path, f"{self.host}:{self.ports[grpc_ports[name]]}")

    def _write_secret(self) -> None:
        """A fresh random secret in ``secret_file``, mode 0600 from its creation on (written
        to a new file and renamed over the old one, so no reader sees it half written)."""
        fresh = self.secret_file.with_name(f".{self.secret_file.name}.{os.getpid()}")
        fresh.unlink(missing_ok=True)
        descriptor = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
        os.replace(fresh, self.secret_file)

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
        self.children = [self._spawn(name) for name in SERVICES]

    def child(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def restart(self, name: str) -> Child:
        """Start ``name`` again on the same ports (after it died or was killed)."""
        old = self.child(name)
        if old.process.poll() is None:
            raise RuntimeError(f"{name} (pid {old.process.pid}) is still running")
        new = self._spawn(name)
        self.children[self.children.index(old)] = new
        return new

    def check_alive(self) -> None:
        for child in self.children:
            if child.process.poll() is not None:
                raise ChildExitedError(child)

    def wait_ready(self, timeout: float, should_stop: callable = lambda: False) -> bool:
        """Wait until every service is SERVING and the controller is ready.

        Returns False if ``should_stop()`` became true first;
        raises ChildExitedError or TimeoutError.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if should_stop():
                return False
            self.check_alive()
            serving = all(
                grpc_health(c.grpc_address, c.grpc_service, timeout=1.0) == "SERVING"
                for c in self.children
            )
            if serving and http_ready(f"{self.rest_url}/readyz", timeout=1.0):
                return True
            time.sleep(0.2)
        raise TimeoutError(f"services not ready after {timeout:.0f}s; logs in {self.log_dir}")

    def stop(self, grace: float, controller_first: bool = False) -> None:
        """SIGTERM the workers, then the controller (so drain notices reach it); SIGKILL
        stragglers. ``controller_first``: the controller ends a running loop (and checkpoints)
        while the workers still answer."""
        workers = [c for c in self.children if c.name != "controller"]
        controller = [c for c in self.children if c.name == "controller"]
        groups = (controller, workers) if controller_first else (workers, controller)
        for group in groups:
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
