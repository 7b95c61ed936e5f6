"""The controller's durable run state: SQLite in the run directory.

What must survive a controller restart: every completed step (metrics, the data position after
it, the policy version it produced) and the step in flight (its data position before and after
and the batch id of its Train, recorded BEFORE Train is called, so a restart can tell whether the
trainer applied it).

A step's metrics are a JSON object; a figure that was not measured (e.g. the loss of a step whose
Train reply was lost) is JSON ``null``, which ``json_extract`` reads as SQL NULL, and the
aggregates below skip it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS steps (
    step INTEGER PRIMARY KEY,
    policy_version INTEGER NOT NULL,
    position_after TEXT NOT NULL,
    metrics TEXT NOT NULL,
    finished_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS pending (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    step INTEGER NOT NULL,
    position_before TEXT NOT NULL,
    position_after TEXT NOT NULL,
    prompt_ids TEXT NOT NULL,
    batch_id TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class StepRecord:
    step: int
    policy_version: int
    position_after: dict[str, Any]
    metrics: dict[str, Any]
    finished_at: float


@dataclass(frozen=True)
class PendingStep:
    step: int
    position_before: dict[str, Any]
    position_after: dict[str, Any]
    prompt_ids: list[str]
    batch_id: str = ""
    """The TrainRequest.batch_id sent for this step ("" when recorded by an older controller)."""


class RunStore:
    """Thread-safe access to ``<run_dir>/controller.sqlite``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: a commit survives the controller process dying (SIGKILL); only an OS
        # crash or power loss can undo the last commits, and a resume then finds a trainer
        # version the records do not know, and goes back to a checkpoint (resume.py).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(pending)")}
        if "batch_id" not in columns:  # a database written before batch ids existed
            self._db.execute("ALTER TABLE pending ADD COLUMN batch_id TEXT NOT NULL DEFAULT ''")
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- steps ---------------------------------------------------------------------------------
    def record_step(self, record: StepRecord) -> None:
        """Store a finished step and clear the pending marker, in one transaction."""
        with self._lock:
            self._db.execute("BEGIN")
            self._db.execute(
                "INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?)",
                (
                    record.step,
                    record.policy_version,
                    json.dumps(record.position_after),
                    json.dumps(record.metrics),
                    record.finished_at,
                ),
            )
            self._db.execute("DELETE FROM pending")
            self._db.execute("COMMIT")

    def _select(self, where: str, args: tuple[Any, ...]) -> list[StepRecord]:
        with self._lock:
            rows = self._db.execute(
                "SELECT step, policy_version, position_after, metrics, finished_at FROM steps "
                + where,
                args,
            ).fetchall()
        return [
            StepRecord(row[0], row[1], json.loads(row[2]), json.loads(row[3]), row[4])
            for row in rows
        ]

    def steps(self, since: int = 0, limit: int | None = None) -> list[StepRecord]:
        """Steps after ``since`` in order; all of them unless ``limit`` is given."""
        return self._select(
            "WHERE step > ? ORDER BY step LIMIT ?", (since, -1 if limit is None else limit)
        )

    def step(self, step: int) -> StepRecord | None:
        found = self._select("WHERE step = ?", (step,))
        return found[0] if found else None

    def last_step(self) -> StepRecord | None:
        found = self._select("ORDER BY step DESC LIMIT 1", ())
        return found[0] if found else None

    def last_step_at_version(self, policy_version: int) -> StepRecord | None:
        """The last step after which the trainer held ``policy_version`` (None if none)."""
        found = self._select(
            "WHERE policy_version = ? ORDER BY step DESC LIMIT 1", (policy_version,)
        )
        return found[0] if found else None

    def measured(self, metric: str, count: int, *, last: bool) -> list[float]:
        """The first (or last) ``count`` measured values of ``metric``, in step order; steps
        where it is unknown (null) or absent are skipped."""
        order = "DESC" if last else "ASC"
        with self._lock:
            rows = self._db.execute(
                "SELECT json_extract(metrics, ?) AS v FROM steps WHERE v IS NOT NULL "
                f"ORDER BY step {order} LIMIT ?",
                (f"$.{metric}", count),
            ).fetchall()
        values = [float(row[0]) for row in rows]
        return values[::-1] if last else values

    def metric_sum(self, metric: str) -> float:
        """Sum of ``metric`` over every step where it was measured (0 if none)."""
        with self._lock:
            row = self._db.execute(
                "SELECT TOTAL(json_extract(metrics, ?)) FROM steps", (f"$.{metric}",)
            ).fetchone()
        return float(row[0])

    def forget_steps_after(self, step: int) -> int:
        """Drop history past ``step`` (the trainer came back from an older checkpoint)."""
        with self._lock:
            return self._db.execute("DELETE FROM steps WHERE step > ?", (step,)).rowcount

    # -- the step in flight --------------------------------------------------------------------
    def set_pending(self, pending: PendingStep) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO pending "
                "(id, step, position_before, position_after, prompt_ids, batch_id) "
                "VALUES (1, ?, ?, ?, ?, ?)",
                (
                    pending.step,
                    json.dumps(pending.position_before),
                    json.dumps(pending.position_after),
                    json.dumps(pending.prompt_ids),
                    pending.batch_id,
                ),
            )

    def pending(self) -> PendingStep | None:
        with self._lock:
            row = self._db.execute(
                "SELECT step, position_before, position_after, prompt_ids, batch_id FROM pending"
            ).fetchone()
        if row is None:
            return None
        return PendingStep(
            row[0], json.loads(row[1]), json.loads(row[2]), json.loads(row[3]), row[4]
        )

    def clear_pending(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM pending")

    # -- small values --------------------------------------------------------------------------
    def put(self, key: str, value: Any) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, json.dumps(value)))

    def get(self, key: str, default: Any = None) -> Any:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default
