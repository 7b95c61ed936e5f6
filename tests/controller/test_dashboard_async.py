"""The dashboard of an async run (loop.mode: async): the rollout buffer's fill, the staleness
histogram and the stale drops, from /v1/status and /v1/steps, rendered by real headless
Chromium against the real REST app; and the same figures on /v1/status and /metrics."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from podrl.config.loop import LoopConfig
from podrl.controller import loop_metrics
from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import RunStore, StepRecord
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RolloutView, RunState
from tests.controller.rest_server import served_rest_app
from tests.harness.chromium import chromium, needs_chromium


def _async_state(
    tmp_path: Path, weight_apply: str = "between_batches"
) -> tuple[RunState, RunStore]:
    registry = PodTable(heartbeat_timeout_seconds=60)
    for component in (1, 2, 3):
        registry.register("pod-0", component, f"127.0.0.1:{50050 + component}", "inc")
    loop = LoopConfig(mode="async", max_staleness=1, prompts_per_step=16, weight_apply=weight_apply)
    state = RunState(
        "async-dash", registry, min_worker_pods=1, steps_total=10, rollout=RolloutView.of(loop)
    )
    state.follow_loop(lambda: "train", buffer_fill=lambda: (1, 16))
    store = RunStore(tmp_path / "controller.sqlite")
    for step in range(1, 5):
        metrics = {
            "reward_mean": 0.1 * step,
            "phase_seconds": {"generate": 0.5, "score": 0.1, "train": 1.0, "sync": 0.05},
            "staleness_histogram": {"0": 16} if step == 1 else {"1": 15},
            "groups_dropped_stale": 0 if step == 1 else 1,
            "samples_dropped_stale": 0 if step == 1 else 8,
            "samples_spanning_versions": 5 if weight_apply == "in_flight" else 0,
        }
        store.record_step(StepRecord(step, step, {"index": step}, metrics, time.time()))
        state.finish_step(step, step, metrics["phase_seconds"], metrics)
        state.count_staleness(metrics)
    return state, store


def test_status_shows_the_buffer_staleness_and_stale_drops(tmp_path: Path) -> None:
    state, store = _async_state(tmp_path)
    try:
        rollout = TestClient(build_rest_app(state, store)).get("/v1/status").json()["rollout"]
    finally:
        store.close()
    assert rollout == {
        "mode": "async",
        "max_staleness": 1,
        "buffer_steps": 1,
        "buffer_groups": 16,
        "buffer_capacity_groups": 32,
        "staleness_histogram": {"0": 16, "1": 45},
        "groups_dropped_stale": 3,
        "samples_dropped_stale": 24,
        "weight_apply": "between_batches",
        "samples_spanning_versions": 0,
    }


def test_status_counts_the_samples_that_spanned_versions(tmp_path: Path) -> None:
    state, store = _async_state(tmp_path, weight_apply="in_flight")
    try:
        rollout = TestClient(build_rest_app(state, store)).get("/v1/status").json()["rollout"]
    finally:
        store.close()
    assert rollout["weight_apply"] == "in_flight"
    assert rollout["samples_spanning_versions"] == 4 * 5


def test_metrics_export_the_buffer_and_staleness(tmp_path: Path) -> None:
    loop_metrics.BUFFER_GROUPS.set(16)
    loop_metrics.BUFFER_CAPACITY_GROUPS.set(32)
    state, store = _async_state(tmp_path)
    try:
        text = TestClient(build_rest_app(state, store)).get("/metrics").text
    finally:
        store.close()
    for name in (
        "podrl_rollout_buffer_groups 16.0",
        "podrl_rollout_buffer_capacity_groups 32.0",
        "podrl_rollout_buffer_steps",
        'podrl_trained_group_staleness_bucket{le="1.0"}',
        "podrl_stale_groups_dropped_total",
        "podrl_stale_samples_dropped_total",
        "podrl_samples_spanning_versions_total",
    ):
        assert name in text, name


@pytest.fixture(params=["between_batches", "in_flight"])
def served_async_run(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    state, store = _async_state(tmp_path, request.param)
    with served_rest_app(state, store) as url:
        yield url


@needs_chromium
def test_dashboard_shows_the_rollout_buffer(
    served_async_run: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    dom = chromium("--dump-dom", f"{served_async_run}/dashboard", user_dir=tmp_path / "p").stdout

    def text_of(element_id: str) -> str:
        found = re.search(rf'id="{element_id}"[^>]*>([^<]*)<', dom)
        assert found, f"#{element_id} missing from the rendered page"
        return found.group(1)

    if "in_flight" in request.node.callspec.id:
        assert text_of("rollout-buffer") == (
            "16 / 32 (async, k = 1, weights in flight: 20 samples spanned versions)"
        )
    else:
        assert text_of("rollout-buffer") == "16 / 32 (async, k = 1)"
    assert text_of("stale-dropped") == "3 (24 samples)"
    assert text_of("staleness") == "0: 16, 1: 45"
    assert 'data-series="1 behind">1 behind: 15.00<' in dom
    assert 'data-series="0 behind">0 behind: 0.000<' in dom
    assert 'data-series="dropped stale">dropped stale: 1.000<' in dom


def test_the_status_has_the_rollout_settings_before_the_loop_is_built() -> None:
    # The state is built with the run's rollout settings, so the status an async run answers
    # before its loop starts already says async (it said sync until the loop set them).
    loop = LoopConfig(mode="async", max_staleness=2, prompts_per_step=5)
    state = RunState("early", PodTable(60), 1, rollout=RolloutView.of(loop))
    rollout = state.view().rollout
    assert (rollout.mode, rollout.max_staleness, rollout.buffer_capacity_groups) == ("async", 2, 15)
    assert (rollout.buffer_steps, rollout.buffer_groups) == (0, 0)  # no producer yet
    assert RolloutView.of(LoopConfig()) == RolloutView()  # sync: no buffer
