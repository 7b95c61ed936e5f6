"""The dashboard, rendered by real headless Chromium against the real REST app."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import RunStore, StepRecord
from podrl.controller.service.status import RunState
from tests.controller.rest_server import served_rest_app
from tests.harness.chromium import chromium, needs_chromium

ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
POD_1 = "pod-1"
pytestmark = needs_chromium


@pytest.fixture
def served_run(tmp_path: Path) -> Iterator[str]:
    table = PodTable(heartbeat_timeout_seconds=60)
    for component in (1, 2, 3):
        table.register("pod-0", component, f"127.0.0.1:{50050 + component}", "inc")
    # A second pod; both are in the roster (admitted at the same step boundary).
    for component in (1, 2, 3):
        table.register(POD_1, component, f"127.0.0.1:{50060 + component}", "inc")
    table.follow_cluster(desired_replicas=lambda: 3)
    table.admit()
    state = RunState("dash-test", table, min_worker_pods=1, steps_total=20)
    store = RunStore(tmp_path / "controller.sqlite")
    for step in range(1, 8):
        metrics = {
            "reward_mean": 0.1 * step,
            "loss": 1.0 / step,
            "pg_loss": 0.5 / step,
            "kl": 0.01 * step,
            "entropy": 3.0 - 0.2 * step,
            "phase_seconds": {"generate": 0.5, "score": 0.1, "train": 1.0, "sync": 0.05},
            "score_errors": step % 3,
            "dropped_samples": 2 * (step % 3),
            "pods": ["pod-0"] if step < 5 else ["pod-0", POD_1],
            "epoch": 1 if step < 5 else 2,
        }
        if step == 7:  # its Train reply was lost: the trainer metrics are unknown
            metrics.update(loss=None, pg_loss=None, metrics_unknown=True)
        store.record_step(StepRecord(step, step, {"index": step}, metrics, time.time()))
        state.finish_step(step, step, metrics["phase_seconds"], metrics)
    state.follow_loop(lambda: "generate")
    with served_rest_app(state, store) as url:
        yield url


def test_dashboard_renders_status_charts_and_workers(served_run: str, tmp_path: Path) -> None:
    url = f"{served_run}/dashboard"
    dom = chromium("--dump-dom", url, user_dir=tmp_path / "profile").stdout

    def text_of(element_id: str) -> str:
        found = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
        assert found, f"#{element_id} missing from the rendered page"
        return found.group(1)

    assert text_of("run-name") == "dash-test"
    assert text_of("step") == "7 / 20"
    assert text_of("policy-version") == "7"
    assert text_of("phase") == "generate"
    assert text_of("reward-latest") == "0.700"
    assert text_of("healthy-pods") == "2"
    assert text_of("desired-replicas") == "3"
    assert text_of("epoch") == "1"
    assert text_of("score-errors-latest") == "1 (dropped 2)"
    # Every chart was drawn from /v1/steps: one polyline per series, legends with last values
    # (the policy-drift group draws the entropy again; its charts without figures are hidden).
    assert len(re.findall(r"<polyline [^>]*points=\"[0-9]", dom)) == 1 + 2 + 2 + 4 + 2 + 2 + 1
    assert 'data-series="pods">pods: 2.000<' in dom and 'data-series="epoch">epoch: 2.000<' in dom
    assert 'data-series="reward_mean">reward_mean: 0.7000<' in dom
    assert 'data-series="entropy">entropy: 1.600<' in dom
    # An unknown figure is a dash, never 0.
    assert 'data-series="loss">loss: \u2014<' in dom
    assert 'data-series="score_errors">score_errors: 1.000<' in dom
    assert dom.count("<td>pod-0</td>") == 3 + 1  # its three processes, and the pods table
    assert "<td>pod-0</td><td>training</td><td>0</td><td>0</td><td>0</td>" in dom
    assert dom.count("<td>pod-1</td>") == 3 + 1
    assert "no data yet</text></svg>" not in dom
    # These steps have no clip split: the drift group's clip chart is hidden, not empty.
    assert '<div class="chart" hidden=""><h2>clip fractions' in dom

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    chromium(f"--screenshot={shot}", "--window-size=1300,900", url, user_dir=tmp_path / "p2")
    assert shot.stat().st_size > 10_000
