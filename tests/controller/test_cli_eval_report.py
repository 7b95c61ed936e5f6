"""What the CLI prints of the held-out evaluation: `podrl status`'s latest evaluation, the
progress row's total, the before/after table and the text reward curve."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from rich.console import Console

from podrl.cli.eval_report import eval_table, planned_evaluations, reward_curve_text
from podrl.cli.status_table import render_status
from podrl.config.loop import LoopConfig

STATUS = {
    "run_name": "demo",
    "phase": "train",
    "ready": True,
    "step": 60,
    "steps_total": 100,
    "policy_version": 58,
    "healthy_pods": ["local-0"],
    "uptime_seconds": 90.0,
    "last_step_metrics": {},
    "workers": [],
    "evaluations": 3,
    "last_eval": {
        "step": 50,
        "policy_version": 48,
        "prompts": 64,
        "accuracy": 0.875,
        "reward_mean": 0.9,
        "error": None,
    },
}


def _printed(renderable_or_status: object, status: bool = False) -> str:
    console = Console(width=200, record=True)
    if status:
        render_status(renderable_or_status, console)  # type: ignore[arg-type]
    else:
        console.print(renderable_or_status)
    return console.export_text()


def test_podrl_status_shows_the_latest_evaluation() -> None:
    text = _printed(STATUS, status=True)
    assert "held-out eval" in text
    assert (
        "accuracy 0.875, mean reward 0.900 on 64 prompts (after step 50, policy version 48)" in text
    )
    failed = {**STATUS, "last_eval": {**STATUS["last_eval"], "accuracy": None, "error": "[b]x"}}
    assert "failed after step 50: [b]x" in _printed(failed, status=True)  # text, not markup


def test_the_progress_row_counts_the_evaluations_a_run_records() -> None:
    assert planned_evaluations(LoopConfig(steps=100, eval_prompts=64, eval_every=25)) == 5
    assert planned_evaluations(LoopConfig(steps=110, eval_prompts=64, eval_every=25)) == 6
    assert planned_evaluations(LoopConfig(steps=100, eval_prompts=64)) == 2
    assert planned_evaluations(LoopConfig(steps=100)) == 0


def test_the_table_has_every_evaluation_and_the_curve_its_ends() -> None:
    rows = [
        {"step": 0, "policy_version": 0, "prompts": 64, "accuracy": 0.297, "reward_mean": 0.5,
         "when": "initial", "error": None},
        {"step": 100, "policy_version": 81, "prompts": 64, "accuracy": 1.0, "reward_mean": 1.0,
         "when": "final", "error": None},
    ]  # fmt: skip
    text = _printed(eval_table(rows))
    assert "0.297" in text and "1.000" in text and "initial" in text and "final" in text
    steps = [{"step": s, "metrics": {"reward_mean": s / 10}} for s in range(1, 11)]
    steps.insert(3, {"step": 99, "metrics": {"reward_mean": None}})  # unknown: left out
    curve = reward_curve_text(steps)
    assert curve.startswith("reward 0.10 |") and "| 1.00" in curve


def test_a_run_of_episodes_adds_its_tool_call_rate_and_accuracy_with_and_without_a_call() -> None:
    tool_use = {"tool_call_rate": 0.75, "accuracy_with_tool": 0.875, "accuracy_without_tool": 0.0}
    rows = [
        {"step": 0, "policy_version": 0, "prompts": 64, "accuracy": 0.05, "reward_mean": 0.05,
         "when": "initial", "error": None, "tool_use": tool_use},
    ]  # fmt: skip
    text = _printed(eval_table(rows))
    assert "tool-call rate" in text and "accuracy with a call" in text
    assert "0.750" in text and "0.875" in text and "0.000" in text
    plain = [{k: v for k, v in rows[0].items() if k != "tool_use"}]
    assert "tool-call rate" not in _printed(eval_table(plain))  # single-turn: as before


def test_the_reward_curve_png_needs_matplotlib_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from podrl.cli.reward_plot import plot_reward_curve

    steps = [{"step": i, "metrics": {"reward_mean": i / 10}} for i in range(1, 6)]
    png = plot_reward_curve(steps, tmp_path / "curve.png", "run")
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert plot_reward_curve(steps, tmp_path / "none.png", "run") is None
    assert not (tmp_path / "none.png").exists()
