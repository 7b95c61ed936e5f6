"""Step records and summary.json: every figure measured or marked unknown, over every
step of a long run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from podrl.config import RunConfig
from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import (
    TRAIN_METRICS,
    RecoveredStep,
    RunStore,
    StepRecord,
    StepRecorder,
    episode_figures,
)
from podrl.controller.service.status import RunState
from podrl.controller.step.batch import StepSamples
from podrl.tasks import PromptItem
from podrl.v1 import common_pb2, grader_pb2, trainer_pb2


@pytest.fixture
def recorder(tmp_path: Path) -> StepRecorder:
    config = RunConfig.model_validate({"name": "rec", "run_dir": str(tmp_path)})
    state = RunState("rec", PodTable(60), 1)
    return StepRecorder(config, state, RunStore(tmp_path / "controller.sqlite"))


def _summary(recorder: StepRecorder) -> dict:
    recorder.write_summary()
    return json.loads((recorder.config.run_dir / "summary.json").read_text())


def test_the_summary_of_a_long_run_reads_its_last_steps(recorder: StepRecorder) -> None:
    """The old summary read the first 10,000 steps only (final reward of steps 9,991-10,000)."""
    for step in range(1, 10_006):
        figures = {"reward_mean": step / 10_005, "tokens_generated": 2, "trained": True}
        recorder.store.record_step(StepRecord(step, step, {}, figures, 0.0))
    recorder.state.resume(10_005, 10_005)
    summary = _summary(recorder)
    assert summary["final_reward_mean"] == pytest.approx(sum(range(9_996, 10_006)) / 10 / 10_005)
    assert summary["initial_reward_mean"] == pytest.approx(3 / 10_005)
    assert summary["tokens_generated"] == 2 * 10_005
    assert summary["steps"] == summary["steps_trained"] == 10_005


def test_a_recovered_step_has_unknown_figures_left_out_of_the_summary(
    recorder: StepRecorder,
) -> None:
    recorder.store.record_step(
        StepRecord(1, 1, {}, {"reward_mean": 0.4, "tokens_generated": 10, "trained": True}, 0.0)
    )
    recovered = RecoveredStep(2, 2, {"index": 8}, ["t/4"], "rec:ab:2:1", train_reply=None)
    record = recorder.record_recovered(recovered)
    stored = recorder.store.step(2)
    assert stored is not None and stored.metrics == record.metrics
    for name in (
        *TRAIN_METRICS,
        "reward_mean",
        "tokens_generated",
        "score_errors",
        "behaviour_age_max",
    ):
        assert stored.metrics[name] is None, name  # unknown, never 0.0
    assert stored.metrics["metrics_unknown"] is True and stored.metrics["recovered"] is True
    assert stored.metrics["drift_warnings"] == []  # unknown figures are outside no band
    recorder.state.resume(2, 2)
    summary = _summary(recorder)
    assert summary["initial_reward_mean"] == summary["final_reward_mean"] == 0.4
    assert summary["tokens_generated"] == 10
    assert summary["steps_with_unknown_metrics"] == 1


def test_a_recovered_step_keeps_the_trainers_stored_reply(recorder: StepRecorder) -> None:
    reply = trainer_pb2.TrainResponse(
        policy_version=1, metrics=trainer_pb2.TrainMetrics(loss=0.75, grad_norm=2.0)
    )
    record = recorder.record_recovered(RecoveredStep(1, 1, {}, [], "rec:ab:1:1", reply))
    assert record.metrics["loss"] == 0.75 and record.metrics["grad_norm"] == 2.0
    assert record.metrics["reward_mean"] is None


def test_drift_warnings_outlive_a_controller_restart_and_leave_with_their_steps(
    recorder: StepRecorder,
) -> None:
    drifting = trainer_pb2.TrainResponse(
        metrics=trainer_pb2.TrainMetrics(mismatch_kl=1.9, update_ratio=1e-5)
    )
    for step in range(1, 24):
        recorder.record_recovered(RecoveredStep(step, step, {}, [], f"rec:ab:{step}:1", drifting))
    # The status keeps the latest 20 warnings, each naming its step and knob.
    assert [w["step"] for w in recorder.state.view().warnings] == list(range(4, 24))
    assert all(w["figure"] == "mismatch_kl" for w in recorder.state.view().warnings)
    # A restarted controller (a new recorder over the same run store) still shows them.
    state = RunState("rec", PodTable(60), 1)
    again = StepRecorder(recorder.config, state, recorder.store)
    assert [w["step"] for w in state.view().warnings] == list(range(4, 24))
    # Steps removed on resume take their warnings with them.
    again.forget_steps_after(10)
    assert [w["step"] for w in state.view().warnings] == list(range(4, 11))


def test_an_episodes_row_in_samples_jsonl_carries_its_turns(recorder: StepRecorder) -> None:
    """A multi-turn episode's row gets its turns; a single-turn sample's row gets none."""
    items = [
        PromptItem(id=f"t/{i}", task="t", prompt="p", reference="r", target="") for i in range(2)
    ]
    data = StepSamples(items=items)
    turn = {"action": "<calc>2*3</calc>", "observation": "<result>6</result>", "tool_calls": 1}
    for item in items:
        data.samples[item.id] = [common_pb2.Sample(prompt_id=item.id, index=0, text="x")]
        data.scores[f"{item.id}#0"] = grader_pb2.ItemScore(id=f"{item.id}#0", reward=1.0)
    data.turns["t/0#0"] = [turn]
    recorder.write_samples(1, data, {"t/0#0", "t/1#0"})
    rows = [json.loads(line) for line in recorder.samples.path.read_text().splitlines()]
    assert rows[0]["turns"] == [turn]
    assert "turns" not in rows[1]


def test_a_steps_episode_figures_sum_its_turns() -> None:
    data = StepSamples(items=[])
    assert episode_figures(data) == {}  # a single-turn step's record is as it was
    turn = {"tool_calls": 1, "tool_errors": 0, "environment_seconds": 0.25}
    data.turns = {"t/0#0": [turn, {**turn, "tool_errors": 1}], "t/0#1": [turn]}
    assert episode_figures(data) == {
        "episodes": 2,
        "episode_turns_mean": 1.5,
        "tool_calls": 3,
        "tool_errors": 1,
        "environment_seconds_mean": 0.25,
    }
