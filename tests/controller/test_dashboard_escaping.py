"""The dashboard shows hostile text from workers and tasks as text (once a worker id
``<img src=x onerror=...>`` ran in headless Chromium). Real REST app, real Chromium, like
tests/controller/test_dashboard.py."""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from podrl.common.processes import free_ports
from podrl.controller.pods.table import MemberView, PodTable
from podrl.controller.records.recorder import RunStore, StepRecord
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RunState
from tests.harness.chromium import chromium, needs_chromium

pytestmark = needs_chromium

# Each payload, if parsed as HTML, adds an element with id "pwned-<n>" to the page.
PAYLOADS = {
    "worker_id": '<img src=x onerror="document.body.appendChild(Object.assign('
    "document.createElement('p'),{id:'pwned-1'}))\">",
    "address": '<svg onload="document.body.appendChild(Object.assign('
    "document.createElement('p'),{id:'pwned-2'}))\"></svg>:1",
    "error": '<img src=x onerror="document.body.appendChild(Object.assign('
    "document.createElement('p'),{id:'pwned-3'}))\">",
    "run_name": "<b id=pwned-4>run</b>",
}


class UncheckedRegistry(PodTable):
    """The real registry refuses such worker ids and addresses (Register validates them: see
    tests/controller/test_membership_guards.py); the page must not rely on that, so this one
    also lists a member it could never have accepted."""

    def members(self) -> list[MemberView]:
        hostile = MemberView(
            worker_id=PAYLOADS["worker_id"],
            component="trainer",
            address=PAYLOADS["address"],
            state="serving",
            healthy=True,
            seconds_since_heartbeat=1.0,
            policy_version=3,
        )
        return [*super().members(), hostile]


@pytest.fixture
def serve_hostile_run(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], str]]:
    """Serves a run with hostile worker, address, error and run name texts and one step with
    the given metrics; returns the dashboard's URL."""
    servers: list[tuple[uvicorn.Server, threading.Thread, RunStore]] = []

    def serve(metrics: dict[str, Any]) -> str:
        registry = UncheckedRegistry(heartbeat_timeout_seconds=60)
        registry.register("pod-0", 1, "127.0.0.1:50051", "inc")
        state = RunState(PAYLOADS["run_name"], registry, min_worker_pods=1, steps_total=5)
        store = RunStore(tmp_path / f"controller-{len(servers)}.sqlite")
        store.record_step(StepRecord(1, 1, {"index": 1}, metrics, time.time()))
        state.finish_step(1, 1, {}, metrics)
        state.set_error(PAYLOADS["error"])
        (port,) = free_ports(1)
        app = build_rest_app(state, store)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread, store))
        while not server.started:
            time.sleep(0.05)
        return f"http://127.0.0.1:{port}/dashboard"

    yield serve
    for server, thread, store in servers:
        server.should_exit = True
        thread.join(timeout=10)
        store.close()


def test_hostile_worker_and_task_text_is_shown_as_text(
    serve_hostile_run: Callable[[dict[str, Any]], str], tmp_path: Path
) -> None:
    """Before this check: on the old page (innerHTML of the worker rows) the worker id's
    onerror handler ran and added #pwned-1, the address's onload #pwned-2."""
    url = serve_hostile_run({"reward_mean": 0.25, "kl": 0.5})
    dom = chromium("--dump-dom", url, user_dir=tmp_path / "p").stdout
    for n in range(1, 5):
        assert f'id="pwned-{n}"' not in dom, f"payload {n} was parsed as HTML"
    # Each payload is on the page, as text: what a user reads is the hostile string itself.
    assert f"<td>{html.escape(PAYLOADS['worker_id'], quote=False)}</td>" in dom
    assert f"<td>{html.escape(PAYLOADS['address'], quote=False)}</td>" in dom
    assert html.escape(f"error: {PAYLOADS['error']}", quote=False) in dom
    assert html.escape(PAYLOADS["run_name"], quote=False) in dom
    assert 'id="reward-latest">0.250<' in dom  # the page rendered to its end


def test_a_metric_that_is_not_a_number_is_shown_as_unknown(
    serve_hostile_run: Callable[[dict[str, Any]], str], tmp_path: Path
) -> None:
    """A worker's metric that is a string (markup, or one that reads like a number) is no
    point and no value: its chart has no data, its card a dash, and the rest of the page still
    renders (the old page called toFixed on it and stopped rendering with 'cannot reach the
    controller')."""
    url = serve_hostile_run(
        {"reward_mean": "<img src=x onerror=alert(1)>", "loss": "1e3", "kl": 0.5}
    )
    dom = chromium("--dump-dom", url, user_dir=tmp_path / "p").stdout
    no_data = 'viewBox="0 0 400 180"><text x="10" y="20" fill="#999">no data yet</text></svg>'
    assert f'<svg id="chart-reward" {no_data}' in dom
    assert f'<svg id="chart-loss" {no_data}' in dom
    assert 'id="reward-latest">\u2014<' in dom
    assert 'data-series="kl">kl: 0.5000<' in dom
    assert "<img" not in dom and "cannot reach the controller:" not in dom.split("<script>")[0]
