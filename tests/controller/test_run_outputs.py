"""samples.jsonl after a resume holds every step once."""

from __future__ import annotations

import json
from pathlib import Path

from podrl.controller.records.recorder import SampleLog


def test_forgetting_steps_removes_their_rows_and_nothing_else(tmp_path: Path) -> None:
    log = SampleLog(tmp_path)
    log.write({"step": step, "index": i} for step in (1, 2, 3, 4) for i in range(2))
    with open(log.path, "a", encoding="utf-8") as out:
        out.write('{"step": 5, "ind')  # a row torn by a crash mid-write
    assert log.forget_steps_after(2) == 2 * 2 + 1
    rows = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(r["step"], r["index"]) for r in rows] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    # The resumed run appends steps 3 and 4 again: each appears once.
    log.write({"step": step, "index": 0} for step in (3, 4))
    steps = [json.loads(line)["step"] for line in log.path.read_text().splitlines()]
    assert steps == [1, 1, 2, 2, 3, 4]
    assert log.forget_steps_after(10) == 0
    assert not (tmp_path / "samples.jsonl.tmp").exists()


def test_forgetting_everything_empties_the_log(tmp_path: Path) -> None:
    log = SampleLog(tmp_path)
    assert log.forget_steps_after(0) == 0  # no log yet
    log.write([{"step": 1}])
    assert log.forget_steps_after(0) == 1
    assert log.path.read_text() == ""
