"""The controller's REST app served over a real socket for a test (uvicorn on a free port)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from podrl.common.processes import free_port
from podrl.controller.records.recorder import RunStore
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RunState


@contextmanager
def served_rest_app(state: RunState, store: RunStore) -> Iterator[str]:
    """Serve ``build_rest_app(state, store)``; yields its base URL; closes ``store`` after."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(build_rest_app(state, store), host="127.0.0.1", port=port, log_config=None)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        store.close()
