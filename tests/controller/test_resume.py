"""Where a restarted controller continues (controller/records/resume.py): every branch, on a real
SQLite run store, plus a run whose database was lost and one past 10,000 steps."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from podrl.config.tasks import TasksConfig
from podrl.controller.records.checkpoint_files import STATE_FILE, newest_checkpoint
from podrl.controller.records.recorder import PendingStep, RunStore, StepRecord
from podrl.controller.records.resume import (
    ControllerState,
    ResumeError,
    TrainerState,
    choose_checkpoint,
    plan_resume,
)
from podrl.tasks import build_task_source
from podrl.v1 import trainer_pb2


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "controller.sqlite")


def _record(store: RunStore, step: int, version: int) -> None:
    store.record_step(StepRecord(step, version, {"index": step * 4}, {"trained": True}, 0.0))


def _history(store: RunStore, versions: list[int]) -> None:
    """Steps 1.. with the policy version each left the trainer at."""
    for step, version in enumerate(versions, start=1):
        _record(store, step, version)


def _pending(step: int, batch_id: str = "run:abc:5:1") -> PendingStep:
    return PendingStep(step, {"index": (step - 1) * 4}, {"index": step * 4}, ["t/1"], batch_id)


# -- choose_checkpoint ---------------------------------------------------------------------------
def test_a_new_run_loads_nothing(store: RunStore) -> None:
    assert choose_checkpoint(0, store, None, None, None) is None


def test_a_trainer_at_version_zero_with_no_records_loads_the_runs_checkpoint_on_disk(
    store: RunStore,
) -> None:
    assert choose_checkpoint(0, store, None, None, "/ck/step-4") == "/ck/step-4"


def test_records_that_never_trained_need_no_checkpoint(store: RunStore) -> None:
    _history(store, [0, 0])
    assert choose_checkpoint(0, store, None, None, "/ck/step-4") is None


def test_a_restarted_trainer_loads_the_recorded_checkpoint_before_one_on_disk(
    store: RunStore,
) -> None:
    _history(store, [0, 1, 2, 3])
    assert choose_checkpoint(0, store, None, "/ck/rec", "/ck/disk") == "/ck/rec"
    assert choose_checkpoint(0, store, None, None, "/ck/disk") == "/ck/disk"
    assert choose_checkpoint(0, store, None, None, None) is None


def test_a_trainer_version_the_records_know_needs_no_checkpoint(store: RunStore) -> None:
    _history(store, [1, 2, 2])
    assert choose_checkpoint(2, store, None, "/ck/rec", "/ck/disk") is None
    assert choose_checkpoint(1, store, None, "/ck/rec", "/ck/disk") is None  # behind the DB
    # One past the last record, with that step in flight: the records know it too.
    assert choose_checkpoint(3, store, _pending(4), "/ck/rec", None) is None


def test_a_trainer_version_nobody_recorded_loads_a_checkpoint(store: RunStore) -> None:
    assert choose_checkpoint(5, store, None, None, "/ck/disk") == "/ck/disk"  # database lost
    _history(store, [1, 2])
    assert choose_checkpoint(4, store, None, "/ck/rec", None) == "/ck/rec"
    assert choose_checkpoint(3, store, None, None, None) is None  # in flight missing: none left


# -- plan_resume ---------------------------------------------------------------------------------
def test_a_step_in_flight_the_trainer_applied_is_recovered_with_its_stored_reply(
    store: RunStore,
) -> None:
    _history(store, [1, 2, 3, 4])
    reply = trainer_pb2.TrainResponse(policy_version=5, metrics=trainer_pb2.TrainMetrics(loss=0.25))
    plan = plan_resume(
        store,
        _pending(5, "run:abc:5:1"),
        TrainerState(5, "run:abc:5:1", reply),
        None,
        checkpoint_loaded=False,
    )
    assert plan.source == "step_in_flight"
    assert (plan.last_step, plan.policy_version, plan.position) == (5, 5, {"index": 20})
    assert plan.recovered is not None and plan.recovered.step == 5
    assert (
        plan.recovered.train_reply is not None and plan.recovered.train_reply.metrics.loss == 0.25
    )
    assert plan.last_step == 5


def test_a_recovered_step_whose_batch_the_trainer_does_not_name_has_unknown_metrics(
    store: RunStore,
) -> None:
    _history(store, [1, 2, 3, 4])
    other = trainer_pb2.TrainResponse(policy_version=5)
    for trainer in (TrainerState(5), TrainerState(5, "run:zzz:5:1", other)):
        plan = plan_resume(store, _pending(5), trainer, None, checkpoint_loaded=False)
        assert plan.recovered is not None and plan.recovered.train_reply is None


def test_a_step_in_flight_the_trainer_did_not_apply_is_forgotten(store: RunStore) -> None:
    _history(store, [1, 2, 3, 4])
    plan = plan_resume(store, _pending(5), TrainerState(4), None, checkpoint_loaded=False)
    assert plan.source == "database" and plan.recovered is None
    assert (plan.last_step, plan.position) == (4, {"index": 16})


def test_a_trainer_behind_the_records_resumes_at_its_version_and_forgets_the_rest(
    store: RunStore,
) -> None:
    _history(store, [1, 2, 2, 3, 4])
    plan = plan_resume(store, None, TrainerState(2), None, checkpoint_loaded=False)
    # Step 3 trained nothing (version stayed 2): the run continues after it.
    assert (plan.last_step, plan.position) == (3, {"index": 12})


def test_after_a_checkpoint_load_the_records_win_when_they_reach_further(store: RunStore) -> None:
    _history(store, [1, 2, 2, 3])
    loaded = ControllerState(2, 2, {"index": 8})
    plan = plan_resume(store, _pending(5), TrainerState(2), loaded, checkpoint_loaded=True)
    assert plan.source == "database" and plan.recovered is None  # no recovery after a load
    assert plan.last_step == 3


def test_after_a_checkpoint_load_without_records_its_controller_state_is_the_position(
    store: RunStore,
) -> None:
    loaded = ControllerState(6, 5, {"index": 24})
    plan = plan_resume(store, None, TrainerState(5), loaded, checkpoint_loaded=True)
    assert plan.source == "checkpoint"
    assert (plan.last_step, plan.policy_version, plan.position) == (6, 5, {"index": 24})
    # Records that stop short of the checkpoint (an older copy of the database) lose too.
    _history(store, [1, 2])
    plan = plan_resume(store, None, TrainerState(5), loaded, checkpoint_loaded=True)
    assert plan.source == "checkpoint" and plan.last_step == 6


def test_a_controller_state_of_another_version_is_not_used(store: RunStore) -> None:
    with pytest.raises(ResumeError, match="policy version 5"):
        plan_resume(store, None, TrainerState(5), ControllerState(6, 4, {}), checkpoint_loaded=True)


def test_a_trainer_at_version_zero_with_nothing_to_go_back_to_starts_over(
    store: RunStore,
) -> None:
    plan = plan_resume(store, None, TrainerState(0), None, checkpoint_loaded=False)
    assert (plan.source, plan.last_step, plan.position) == ("start", 0, None)
    _history(store, [1, 2, 3])  # trained, but the trainer restarted and no checkpoint exists
    plan = plan_resume(store, None, TrainerState(0), None, checkpoint_loaded=False)
    assert (plan.source, plan.last_step) == ("start", 0)


def test_untrained_first_steps_survive_a_trainer_that_starts_over(store: RunStore) -> None:
    _history(store, [0, 0, 1, 2])
    plan = plan_resume(store, None, TrainerState(0), None, checkpoint_loaded=False)
    # The trainer at version 0 holds exactly what steps 1-2 left (they trained nothing).
    assert (plan.source, plan.last_step) == ("database", 2)


def test_a_version_nothing_records_fails_the_resume_clearly(store: RunStore) -> None:
    with pytest.raises(ResumeError, match="no checkpoint was found"):
        plan_resume(store, None, TrainerState(3), None, checkpoint_loaded=False)
    with pytest.raises(ResumeError, match="carries no controller state"):
        plan_resume(store, None, TrainerState(3), None, checkpoint_loaded=True)


def test_resume_past_ten_thousand_steps_picks_the_last_step(store: RunStore) -> None:
    """With 10,005 steps the run continues after step 10,005, not 10,000."""
    for step in range(1, 10_006):
        _record(store, step, step)
    assert choose_checkpoint(10_005, store, None, None, None) is None
    plan = plan_resume(store, None, TrainerState(10_005), None, checkpoint_loaded=False)
    assert (plan.last_step, plan.position) == (10_005, {"index": 40_020})
    assert len(store.steps()) == 10_005


# -- the controller state blob -------------------------------------------------------------------
def test_controller_state_round_trips_and_foreign_blobs_are_ignored() -> None:
    state = ControllerState(12, 9, {"draws": 48, "tasks": {"copy": {"index": 48}}})
    assert ControllerState.decode(state.encode()) == state
    for blob in (b"", b"\xff", b"[1]", b'{"step": "x"}', b'{"step": 1, "policy_version": 1}'):
        assert ControllerState.decode(blob) is None


# -- the run database is lost, the checkpoint's controller state carries the run -----------
def _write_checkpoint(folder: Path, step: int, state: ControllerState | None) -> None:
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    blob = state.encode() if state else b""
    (folder / STATE_FILE).write_text(
        json.dumps({"step": step, "controller_state": base64.b64encode(blob).decode()})
    )


def test_newest_checkpoint_skips_writes_in_progress_and_incomplete_folders(tmp_path: Path) -> None:
    assert newest_checkpoint(tmp_path / "none") is None
    _write_checkpoint(tmp_path / "step-00000004", 4, None)
    _write_checkpoint(tmp_path / "step-00000008", 8, None)
    _write_checkpoint(tmp_path / ".step-00000012", 12, None)
    _write_checkpoint(tmp_path / "step-00000016.tmp", 16, None)
    (tmp_path / "step-00000020").mkdir()  # no state file: incomplete
    assert newest_checkpoint(tmp_path) == (tmp_path / "step-00000008").absolute()


def test_newest_checkpoint_orders_by_the_version_of_either_state_format(tmp_path: Path) -> None:
    _write_checkpoint(tmp_path / "step-00000004", 4, None)  # format 1: a top-level step
    newer = tmp_path / "step-00000006"
    newer.mkdir()
    (newer / ".metadata").write_bytes(b"")
    (newer / STATE_FILE).write_text(
        json.dumps({"format": 2, "train_state": {"policy_version": 6}, "controller_state": ""})
    )
    assert newest_checkpoint(tmp_path) == newer.absolute()


def test_the_state_file_name_is_the_trainers() -> None:
    from podrl.trainer import checkpoint

    assert STATE_FILE == checkpoint.STATE_FILE


def test_a_lost_database_resumes_from_the_checkpoint_without_repeating_a_prompt(
    tmp_path: Path,
) -> None:
    tasks = TasksConfig.model_validate(
        {
            "definitions": [
                {
                    "name": "copy",
                    "source": {"kind": "procedural", "generator": "copy"},
                    "rewards": [{"name": "exact_match"}],
                }
            ]
        }
    )
    per_step = 3
    source = build_task_source(tasks)
    first = RunStore(tmp_path / "run" / "controller.sqlite")
    drawn: list[list[str]] = []
    checkpoints = tmp_path / "run" / "checkpoints"
    for step in range(1, 7):
        drawn.append([item.id for item in source.next_prompts(per_step)])
        first.record_step(StepRecord(step, step, source.position(), {"trained": True}, 0.0))
        if step == 4:  # a checkpoint after step 4, as GrpoLoop.checkpoint writes it
            state = ControllerState(step, step, source.position())
            _write_checkpoint(checkpoints / f"step-{step:08d}", step, state)
    # An uninterrupted run would draw these for step 7 onwards.
    expected_after = [item.id for item in source.next_prompts(per_step * 3)]
    first.close()
    (tmp_path / "run" / "controller.sqlite").unlink()

    store = RunStore(tmp_path / "run" / "controller.sqlite")  # empty: the database is gone
    on_disk = newest_checkpoint(checkpoints)
    assert on_disk is not None
    for trainer_version in (0, 6):  # the trainer restarted, or it kept running at version 6
        path = choose_checkpoint(trainer_version, store, None, None, str(on_disk))
        assert path == str(on_disk)
    # The trainer loads it: version 4, and hands back the controller state stored with it.
    saved = json.loads((Path(path) / STATE_FILE).read_text())["controller_state"]
    loaded = ControllerState.decode(base64.b64decode(saved))
    plan = plan_resume(store, None, TrainerState(4), loaded, checkpoint_loaded=True)
    assert (plan.source, plan.last_step, plan.policy_version) == ("checkpoint", 4, 4)

    resumed = build_task_source(tasks)
    assert plan.position is not None
    resumed.restore(plan.position)
    redo = [[item.id for item in resumed.next_prompts(per_step)] for _ in range(2)]
    assert redo == drawn[4:6], "steps 5 and 6 are redone with the same prompts"
    later = [item.id for item in resumed.next_prompts(per_step * 3)]
    assert later == expected_after
    # Trained once each: steps 1-4 (in the checkpoint), then 5, 6, ... from the resumed source.
    trained = [pid for ids in drawn[:4] + redo for pid in ids] + later
    assert len(trained) == len(set(trained)), "a prompt was trained on twice"
    assert trained == [f"copy/{i}" for i in range(len(trained))], "a prompt was skipped"
