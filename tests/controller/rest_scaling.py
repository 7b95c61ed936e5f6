"""The controller's REST app with a scaler, served for a test, and the operator token it wants."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn

from podrl.common.auth import OPERATOR, RunSecret, load_run_secret
from podrl.common.processes import free_port
from podrl.config.auth import AuthConfig
from podrl.controller.pods.scaling import ReplicaScaler
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RunState

MAX = 4


def suite_secret() -> RunSecret:
    """The run secret the suite sets for every service (tests/conftest.py)."""
    secret = load_run_secret(AuthConfig())
    assert secret is not None
    return secret


def operator_headers(secret: RunSecret | None = None) -> dict[str, str]:
    """What ``podrl scale`` sends: an operator token signed with the run secret."""
    token = (secret or suite_secret()).rest_token(OPERATOR, "test-operator")
    return {"Authorization": f"Bearer {token}"}


Serve = Callable[..., str]


def serving() -> Iterator[Serve]:
    """(The ``serve`` fixture of tests/controller/conftest.py.) The real REST app on a free
    port, holding the suite's run secret unless ``app_options`` say otherwise (``secret=``,
    ``auth_disabled=``); its base URL."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(state: RunState, scaler: ReplicaScaler | None, **app_options: Any) -> str:
        port = free_port()
        app_options.setdefault("secret", suite_secret())
        app = build_rest_app(state, None, scaler, MAX, **app_options)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                httpx.get(f"{url}/healthz", timeout=1)
                return url
            except httpx.HTTPError:
                threading.Event().wait(0.05)
        raise AssertionError("the REST app did not start")

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)
