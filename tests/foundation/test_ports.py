"""A port that cannot be bound stops the service at start: exit 2, a message naming the port's
config field and its variable, no traceback — for every port (rows 55-57 of the 2026-12-01
probe). Each service runs as its own process, as `podrl up` and the images start it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from podrl.common.processes import ephemeral_port_range, free_ports


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port some other program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _start(service: str, run_dir: Path, **ports: int) -> subprocess.CompletedProcess[str]:
    """``python -m podrl.<service>`` with these PODRL_* ports; waits for it to end (a service
    that starts instead runs until the timeout, which fails the test)."""
    free = iter(free_ports(4))
    env = {
        **os.environ,
        "PODRL_CONTROLLER__GRPC_PORT": str(next(free)),
        "PODRL_CONTROLLER__HTTP_PORT": str(next(free)),
        "PODRL_GRADER__GRPC_PORT": str(next(free)),
        "PODRL_GRADER__METRICS_PORT": str(next(free)),
        "PODRL_GRADER__WORKERS": "1",
        "PODRL_LOG__FORMAT": "text",
        "PODRL_RUN_DIR": str(run_dir),
        **{f"PODRL_{name.upper()}": str(port) for name, port in ports.items()},
    }
    return subprocess.run(
        [sys.executable, "-m", f"podrl.{service}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )


def _assert_refused(done: subprocess.CompletedProcess[str], field: str, port: int) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{field}: cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "PODRL_" + field.upper().replace(".", "__") in done.stderr  # how to choose another
    assert "Traceback" not in done.stderr


def test_the_controller_stops_when_its_rest_port_is_in_use(held_port: int, tmp_path: Path) -> None:
    """Before this check: the controller kept running without its REST API (uvicorn only logged the
    bind error and ended its thread)."""
    _assert_refused(
        _start("controller", tmp_path, controller__http_port=held_port),
        "controller.http_port",
        held_port,
    )


def test_the_grader_stops_when_its_metrics_port_is_in_use(held_port: int, tmp_path: Path) -> None:
    """Before this check: a raw OSError traceback."""
    _assert_refused(
        _start("grader", tmp_path, grader__metrics_port=held_port), "grader.metrics_port", held_port
    )


def test_the_grader_stops_when_its_grpc_port_is_in_use(held_port: int, tmp_path: Path) -> None:
    """A busy gRPC port of the grader stops it with exit 2 naming the field."""
    _assert_refused(
        _start("grader", tmp_path, grader__grpc_port=held_port), "grader.grpc_port", held_port
    )


def test_a_grpc_port_another_grpc_server_serves_is_in_use(tmp_path: Path) -> None:
    """gRPC binds with SO_REUSEPORT by default: a second podrl service on the port of a
    running gRPC server (another service, a second copy) bound it too and silently took a
    share of its calls. Now its bind fails like any other."""
    other = grpc.server(futures.ThreadPoolExecutor(max_workers=1))  # gRPC's default options
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        _assert_refused(
            _start("controller", tmp_path, controller__grpc_port=port), "controller.grpc_port", port
        )
    finally:
        other.stop(grace=None)


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    """A port from the ephemeral range can be taken by any outgoing connection before its
    service binds it (CI saw a grader exit 2, port in use): chosen ports are below it."""
    low, _high = ephemeral_port_range()
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(port < low for port in ports), (ports, low)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_process_never_offers_the_same_port_twice() -> None:
    """A service given a port may still be importing torch when the next one is chosen (CI: a
    trainer found its port taken): the ports a process offers are all different."""
    offered = [port for _ in range(500) for port in free_ports(1)]
    assert len(set(offered)) == len(offered)


def test_a_forked_child_walks_its_own_ports() -> None:
    """A child forked after its parent chose ports does not offer the parent's next ones."""
    free_ports(1)  # the parent's walk has started
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: its next ports, to the parent
        os.close(read)
        os.write(write, json.dumps(free_ports(4)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child_ports = json.loads(pipe.read())
    os.waitpid(child, 0)
    assert not set(child_ports) & set(free_ports(4)), child_ports
