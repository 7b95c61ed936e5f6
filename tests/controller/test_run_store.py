"""The controller's durable run state survives a reopen and keeps steps and the step in flight."""

from __future__ import annotations

from pathlib import Path

from podrl.controller.records.recorder import PendingStep, RunStore, StepRecord


def test_steps_pending_and_values_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "controller.sqlite"
    store = RunStore(path)
    store.set_pending(PendingStep(1, {"index": 0}, {"index": 4}, ["t/0", "t/1", "t/2", "t/3"]))
    store.put("checkpoint", {"path": "ckpt/step-1", "step": 1})
    store.close()

    store = RunStore(path)
    pending = store.pending()
    assert pending is not None and pending.prompt_ids == ["t/0", "t/1", "t/2", "t/3"]
    assert store.get("checkpoint") == {"path": "ckpt/step-1", "step": 1}
    store.record_step(StepRecord(1, 1, {"index": 4}, {"reward_mean": 0.5}, 1.0))
    assert store.pending() is None, "recording a step clears the step in flight"
    store.record_step(StepRecord(2, 1, {"index": 8}, {"reward_mean": 0.6}, 2.0))
    store.record_step(StepRecord(3, 2, {"index": 12}, {"reward_mean": 0.7}, 3.0))
    assert [s.step for s in store.steps(since=1)] == [2, 3]
    assert store.last_step().position_after == {"index": 12}
    assert store.forget_steps_after(1) == 2
    assert store.last_step().step == 1
    assert store.step(2) is None
    store.close()


def test_past_ten_thousand_steps_every_step_is_read(tmp_path: Path) -> None:
    """Before: steps() stopped at 10,000 rows, so resume and the summary read the wrong end."""
    store = RunStore(tmp_path / "controller.sqlite")
    for step in range(1, 10_006):
        metrics = {"reward_mean": None if step == 10_004 else step / 10_005, "trained": True}
        store.record_step(StepRecord(step, step, {"index": step}, metrics, float(step)))
    assert len(store.steps()) == 10_005
    assert store.steps()[-1].step == store.last_step().step == 10_005
    assert [s.step for s in store.steps(since=10_000, limit=3)] == [10_001, 10_002, 10_003]
    assert store.last_step_at_version(10_002).step == 10_002
    # The last measured values, in step order, skipping the unknown one at step 10,004.
    last = store.measured("reward_mean", 3, last=True)
    assert last == [10_002 / 10_005, 10_003 / 10_005, 1.0]
    assert store.measured("reward_mean", 2, last=False) == [1 / 10_005, 2 / 10_005]
    assert store.metric_sum("trained") == 10_005
    store.close()


def test_a_pending_step_keeps_its_batch_id_and_old_databases_are_migrated(
    tmp_path: Path,
) -> None:
    import sqlite3

    path = tmp_path / "controller.sqlite"
    old = sqlite3.connect(path)  # the schema before batch ids
    old.executescript(
        "CREATE TABLE pending (id INTEGER PRIMARY KEY CHECK (id = 1), step INTEGER NOT NULL, "
        "position_before TEXT NOT NULL, position_after TEXT NOT NULL, prompt_ids TEXT NOT NULL);"
        "INSERT INTO pending VALUES (1, 3, '{}', '{}', '[]');"
    )
    old.commit()
    old.close()
    store = RunStore(path)
    assert store.pending() == PendingStep(3, {}, {}, [], "")
    store.set_pending(PendingStep(4, {"index": 12}, {"index": 16}, ["t/12"], "run:ab:4:2"))
    assert store.pending().batch_id == "run:ab:4:2"
    store.close()
