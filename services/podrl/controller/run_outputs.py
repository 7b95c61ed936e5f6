"""What a run leaves in its directory for people: samples (JSONL) and summary.json."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class SampleLog:
    """Appends one JSON object per sample to ``<run_dir>/samples.jsonl``."""

    def __init__(self, run_dir: Path) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "samples.jsonl"
        self._lock = threading.Lock()

    def write(self, rows: Iterable[dict[str, Any]]) -> None:
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        with self._lock, open(self.path, "a", encoding="utf-8") as out:
            out.write(text)


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = run_dir / "summary.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=2, sort_keys=True))
    tmp.replace(path)
    return path
