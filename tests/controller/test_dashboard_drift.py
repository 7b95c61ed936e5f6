"""The dashboard's policy-drift group: the last trained step's drift figures, the charts, and
the badge when a step left the band of loop.drift_warnings, rendered by real headless Chromium
against the real REST app (a screenshot proves it paints)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from podrl.config.loop import DriftWarningsConfig
from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import RunStore, StepRecord, drift_warnings
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RunState
from tests.controller.rest_server import served_rest_app
from tests.harness.chromium import chromium, needs_chromium

DRIFT = {
    "mismatch_kl": 0.001,
    "logprob_diff_mean": 0.02,
    "is_weight_max": 1.25,
    "is_masked_fraction": 0.0,
    "clip_fraction_low": 0.01,
    "clip_fraction_high": 0.02,
    "clip_fraction_dual": 0.0,
    "entropy": 1.5,
    "grad_norm": 0.8,
    "update_ratio": 2e-5,
    "behaviour_age_mean": 0.5,
    "behaviour_age_max": 1,
}


def _drifting_run(tmp_path: Path, last_mismatch: float) -> tuple[RunState, RunStore]:
    """Three trained steps; the last one's mismatch KL is ``last_mismatch`` and its grad norm
    unknown. The warnings come as the recorder makes them (records/recorder.py's drift_warnings)."""
    registry = PodTable(heartbeat_timeout_seconds=60)
    for component in (1, 2, 3):
        registry.register("pod-0", component, f"127.0.0.1:{50050 + component}", "inc")
    state = RunState("drift-dash", registry, min_worker_pods=1, steps_total=10)
    store = RunStore(tmp_path / "controller.sqlite")
    for step in range(1, 4):
        metrics = {"trained": True, "reward_mean": 0.1 * step, **DRIFT}
        if step == 3:
            metrics.update(mismatch_kl=last_mismatch, grad_norm=None)
        warnings = drift_warnings(step, metrics, DriftWarningsConfig())
        metrics["drift_warnings"] = warnings
        state.set_warnings(state.warnings + warnings)
        store.record_step(StepRecord(step, step, {"index": step}, metrics, time.time()))
        state.finish_step(step, step, {}, metrics)
    return state, store


def test_steps_and_status_carry_the_drift_figures_and_warnings(tmp_path: Path) -> None:
    state, store = _drifting_run(tmp_path, last_mismatch=1.9)
    try:
        client = TestClient(build_rest_app(state, store))
        steps = client.get("/v1/steps").json()
        status = client.get("/v1/status").json()
    finally:
        store.close()
    assert steps[0]["metrics"]["update_ratio"] == pytest.approx(2e-5)
    assert steps[2]["metrics"]["grad_norm"] is None  # unknown stays null
    [warning] = status["warnings"]
    assert warning["step"] == 3 and warning["figure"] == "mismatch_kl"
    assert warning["value"] == pytest.approx(1.9) and warning["limit"] == pytest.approx(0.02)
    assert "trainer.lr" in warning["knobs"] and "trainer.off_policy.mask" in warning["knobs"]
    assert warning["message"].startswith("step 3: mismatch_kl 1.9 > 0.02")


@pytest.fixture(params=[1.9, 0.002], ids=["drifting", "in-band"])
def served_run(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, float]]:
    state, store = _drifting_run(tmp_path, request.param)
    with served_rest_app(state, store) as url:
        yield url, request.param


@needs_chromium
def test_dashboard_shows_the_drift_card_charts_and_badge(
    served_run: tuple[str, float], tmp_path: Path
) -> None:
    url, mismatch = served_run
    dom = chromium("--dump-dom", f"{url}/dashboard", user_dir=tmp_path / "p").stdout
    # The card: the last trained step's figures, an unknown one as "—", never 0.
    shown = {1.9: "1.90", 0.002: "0.00200"}[mismatch]  # three digits
    assert f'data-figure="mismatch_kl">mismatch KL: {shown}<' in dom
    assert 'data-figure="grad_norm">grad norm: \u2014<' in dom
    assert 'data-figure="update_ratio">update: 2.00e-5<' in dom
    assert 'data-figure="behaviour_age_max">age max: 1.00<' in dom
    for title in (
        "trainer/generator mismatch",
        "clip fractions",
        "entropy and grad",
        "update size",
    ):
        assert f'<div class="chart"><h2>{title}' in dom, title  # drawn, not hidden
    for series in ("mismatch_kl", "|Δlogp| mean", "w max", "masked", "low", "high", "dual"):
        assert f'data-series="{series}"' in dom, series
    assert 'data-series="update_ratio">update_ratio: 0.00002000<' in dom
    # The flat update-size series gets an axis of its own size, not one of +-0.5.
    update_chart = dom[dom.index('id="chart-update"') : dom.index('id="legend-update"')]
    assert ">3.00e-5<" in update_chart and ">1.00e-5<" in update_chart, update_chart
    badge = re.search(r'<div class="badge" id="drift-badge"([^>]*)>([^<]*)<', dom)
    assert badge, "#drift-badge missing from the rendered page"
    if mismatch > DriftWarningsConfig().mismatch_kl_max:
        assert "hidden" not in badge.group(1)
        assert badge.group(2).startswith("\u26a0 1 drift warning; latest step 3: mismatch_kl 1.9")
        assert "lower trainer.lr" in badge.group(2)
    else:
        assert "hidden" in badge.group(1) and badge.group(2) == ""
    shot = tmp_path / "dashboard-drift.png"
    chromium(
        f"--screenshot={shot}",
        "--window-size=1300,1400",
        f"{url}/dashboard",
        user_dir=tmp_path / "p2",
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
