"""The dashboard's evaluation card and chart, rendered by real headless Chromium against the
real REST app (tests/controller/test_dashboard.py has the rest of the page)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import EVALS_KEY, RunStore
from podrl.controller.service.status import RunState
from tests.controller.rest_server import served_rest_app
from tests.harness.chromium import chromium, needs_chromium

pytestmark = needs_chromium


def _evaluation(step: int, accuracy: float | None, error: str | None = None) -> dict:
    return {
        "step": step,
        "policy_version": step,
        "when": "initial" if step == 0 else "periodic",
        "prompts": 64,
        "accuracy": accuracy,
        "reward_mean": None if accuracy is None else accuracy + 0.1,
        "by_task": {},
        "seconds": 0.2,
        "finished_at": time.time(),
        "error": error,
    }


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    state = RunState("eval-dash", PodTable(60), min_worker_pods=1, steps_total=100)
    store = RunStore(tmp_path / "controller.sqlite")
    # The evaluation after step 50 failed: no figures, a gap in the chart, not a 0.
    evaluations = [_evaluation(0, 0.125), _evaluation(50, None, "generator down"),
                   _evaluation(100, 0.625)]  # fmt: skip
    store.put(EVALS_KEY, evaluations)
    state.set_evaluations(evaluations[-1], len(evaluations))
    with served_rest_app(state, store) as url:
        yield url


def test_the_eval_card_and_chart_show_the_evaluations(served: str, tmp_path: Path) -> None:
    dom = chromium("--dump-dom", f"{served}/dashboard", user_dir=tmp_path / "profile").stdout
    card = re.search(r'id="eval-latest"[^>]*>([^<]*)<', dom)
    assert card and card.group(1) == "0.625 (step 100)"
    chart = re.search(r'<svg id="chart-eval"[^>]*>(.*?)</svg>', dom, re.S)
    assert chart and len(re.findall(r"<polyline ", chart.group(1))) == 2
    # The failed evaluation is left out: each line has the two measured points only.
    for points in re.findall(r'points="([^"]*)"', chart.group(1)):
        assert len(points.split()) == 2
    assert 'data-series="accuracy">accuracy: 0.6250<' in dom
    assert 'data-series="reward_mean">reward_mean: 0.7250<' in dom
