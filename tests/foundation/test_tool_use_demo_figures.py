"""The tool-use demo's figures that README.md and docs/demo.md state are the committed runs of
bench/tool_use_demo.py (bench/results/tool_use_demo.json and its ``tool_use_demo_*.json``
variants, one per invocation): a page that states other figures fails here, so the claim cannot
drift from the measurement."""

from __future__ import annotations

import json
from pathlib import Path

from bench.results_table import RESULTS, bench_files

ROOT = Path(__file__).resolve().parents[2]
RUNS = [
    run
    for path in bench_files("tool_use_demo", RESULTS)
    for run in json.loads(path.read_text())["runs"]
]


def _text(name: str) -> str:
    return " ".join((ROOT / name).read_text().split())


def _range(values: list[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}\u2013{high}"


def _seeds() -> str:
    count = len(RUNS)
    return "one seed" if count == 1 else f"{count} seeds"


def claim() -> str:
    """The sentence README.md and docs/demo.md state: held-out accuracy before and after RL."""
    before = [run["before"]["accuracy"] for run in RUNS]
    after = [run["after"]["accuracy"] for run in RUNS]
    return f"held-out accuracy {_range(before)} → {_range(after)} ({_seeds()}"


def test_readme_and_the_demo_page_state_the_committed_runs_accuracy() -> None:
    for page in ("README.md", "docs/demo.md"):
        assert claim() in _text(page), (page, claim())


def test_the_demo_pages_table_has_each_runs_figures() -> None:
    page = _text("docs/demo.md")
    for run in RUNS:
        before, after = run["before"], run["after"]
        cells = [
            str(run["seed"]),
            f"{before['accuracy']:.3f} → {after['accuracy']:.3f}",
            f"{before['tool_call_rate']:.2f} → {after['tool_call_rate']:.2f}",
            "—" if after["accuracy_with_tool"] is None else f"{after['accuracy_with_tool']:.3f}",
            "—"
            if after["accuracy_without_tool"] is None
            else f"{after['accuracy_without_tool']:.3f}",
        ]
        row = "| " + " | ".join(cells) + " |"
        assert row in page, row


def test_the_readmes_run_time_and_tool_use_are_the_committed_runs() -> None:
    """README's "about N min each" is the runs' wall time, and "every episode calling the tool"
    holds only while every run's held-out episodes after RL all called it."""
    readme = _text("README.md")
    minutes = {round(run["wall_seconds"] / 60) for run in RUNS}
    assert len(minutes) == 1, minutes
    assert f"about {minutes.pop()} min each" in readme
    if "every episode calling the tool" in readme:
        assert all(run["after"]["tool_call_rate"] == 1.0 for run in RUNS)
