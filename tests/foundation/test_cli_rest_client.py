"""`podrl up`/`run` reach the controller's REST API through one client: ``httpx.get`` builds a
client, and its TLS context, per call (tens of milliseconds of CPU), and the run's progress loop
calls twice a second."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from podrl.cli.local_cluster import LocalCluster
from podrl.cli.probes import http_ready
from podrl.cli.run_progress import _status
from podrl.config import load_config


class _Controller(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"desired_replicas": 1, "phase": "running"}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def rest_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Controller)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def test_the_progress_loop_builds_no_client_per_request(
    tmp_path: Path, rest_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(env={"PODRL_RUN_DIR": str(tmp_path)})
    cluster = LocalCluster(config, None)
    monkeypatch.setattr(LocalCluster, "rest_url", property(lambda self: rest_url))
    built = []
    original = httpx.Client.__init__

    def counting(self: httpx.Client, *args: object, **kwargs: object) -> None:
        built.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", counting)
    for _ in range(3):
        cluster.follow_desired()
        assert _status(cluster) == {"desired_replicas": 1, "phase": "running"}
        assert http_ready(f"{rest_url}/readyz", client=cluster.http)
    assert built == []
    assert cluster.desired_replicas() == 1
