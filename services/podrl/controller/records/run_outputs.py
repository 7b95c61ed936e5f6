"""What a run leaves in its directory for people: samples (JSONL) and summary.json."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class SampleLog:
    """Appends one JSON object per sample to ``<run_dir>/<name>`` (``samples.jsonl``)."""

    def __init__(self, run_dir: Path, name: str = "samples.jsonl") -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / name
        self._lock = threading.Lock()

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        with self._lock, open(self.path, "a", encoding="utf-8") as out:
            out.write(text)

    def forget_steps_after(self, step: int) -> int:
        """Remove the rows of steps after ``step`` (steps a resume will run again), so no step
        appears twice. The log is rewritten to a temporary file and renamed over the old one, so
        a crash leaves either the old or the new log. Returns the number of rows removed."""
        with self._lock:
            if not self.path.exists():
                return 0
            tmp = self.path.with_suffix(".jsonl.tmp")
            removed = 0
            with (
                open(self.path, encoding="utf-8") as source,
                open(tmp, "w", encoding="utf-8") as kept,
            ):
                for line in source:
                    if not line.strip():
                        continue
                    try:
                        row_step = json.loads(line).get("step")
                    except json.JSONDecodeError:
                        row_step = None  # a line torn by a crash mid-write: drop it
                    if isinstance(row_step, int) and row_step <= step:
                        kept.write(line if line.endswith("\n") else line + "\n")
                    else:
                        removed += 1
            if removed:
                tmp.replace(self.path)
            else:
                tmp.unlink()
            return removed


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = run_dir / "summary.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
    tmp.replace(path)
    return path
