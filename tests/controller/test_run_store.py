"""The controller's durable run state survives a reopen and keeps steps and the step in flight."""

from __future__ import annotations

from pathlib import Path

from podrl.controller.run_store import PendingStep, RunStore, StepRecord


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
