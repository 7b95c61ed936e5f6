"""The committed bench tables are what bench/results_table.py renders from the committed JSON.

A design page states a current figure and links to `bench/results/<bench>.md`; these checks keep
that table from drifting from the JSON it is rendered from, without running any bench."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench import results_table
from bench.results_table import LAYOUTS, RESULTS, bench_files, render, split

BENCH_DIR = RESULTS.parent


@pytest.mark.parametrize("bench", sorted(LAYOUTS))
def test_the_committed_table_is_the_rendered_one(bench: str) -> None:
    files = bench_files(bench, RESULTS)
    if not files:
        pytest.skip(f"no committed JSON of bench/{bench}.py")
    table = RESULTS / f"{bench}.md"
    assert table.exists(), f"{table.name} missing: run `python -m bench.results_table`"
    generated, _notes = split(table.read_text())
    assert generated == render(bench, files), (
        f"{table.name} differs from its JSON: run `python -m bench.results_table` and commit it"
    )


def test_every_committed_json_has_a_bench_table() -> None:
    owned = {path for bench in LAYOUTS for path in bench_files(bench, RESULTS)}
    orphans = sorted(p.name for p in RESULTS.glob("*.json") if p not in owned)
    assert not orphans, f"JSON no table renders (add a layout in bench/results_table.py): {orphans}"


@pytest.mark.parametrize("bench", sorted(LAYOUTS))
def test_every_bench_dates_its_json_and_renders_its_table(bench: str) -> None:
    source = (BENCH_DIR / f"{bench}.py").read_text()
    assert f'results_table.update("{bench}"' in source, f"bench/{bench}.py never calls update"
    # bench/vllm_cuda.py records its own start time (Results.started), which dates its rows;
    # its device script rebuilds Results from the JSON, so the JSON takes no other keys.
    if bench != "vllm_cuda":
        assert "results_table.stamp()" in source, f"bench/{bench}.py writes no date into its JSON"


def test_a_stamp_names_the_utc_date_and_the_checked_out_commit() -> None:
    stamp = results_table.stamp()
    assert stamp["date"] is not None and stamp["date"].endswith(" UTC")
    head = subprocess.run(
        ["git", "-C", str(BENCH_DIR), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert stamp["commit"] == head.stdout.strip()


def test_update_renders_every_json_of_the_bench_and_keeps_the_notes(tmp_path: Path) -> None:
    old = {"machine": {"cpus": 2}, "rows": [{"kind": "in_flight", "round_trip_ms_median": 80}]}
    (tmp_path / "in_flight_apply.json").write_text(json.dumps(old))
    new = {"date": "2026-12-03", "commit": "abc1234", "machine": {"cpus": 2}, "rows": []}
    new["rows"] = [{"kind": "in_flight", "round_trip_ms_median": 12.5}]
    written = tmp_path / "in_flight_apply_x.json"
    written.write_text(json.dumps(new))
    (tmp_path / "in_flight_apply.md").write_text(f"old table\n{results_table.END_MARKER}\nkept\n")

    table = results_table.update("in_flight_apply", written)

    generated, notes = split(table.read_text())
    assert notes == "kept\n"
    rows = [line for line in generated.splitlines() if line.startswith("| `")]
    assert rows == [
        "| `in_flight_apply.json` |  |  | 2 |  |  | in_flight | 80 |  |  |",
        "| `in_flight_apply_x.json` | 2026-12-03 | abc1234 | 2 |  |  | in_flight | 12.5 |  |  |",
    ]


def test_a_bench_owns_its_json_and_its_variants(tmp_path: Path) -> None:
    for name in ("scaling.json", "scaling_cpu.json", "scaling_rewards.json", "scalingx.json"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in bench_files("scaling", tmp_path)] == [
        "scaling.json",
        "scaling_cpu.json",
        "scaling_rewards.json",
    ]
