"""A run without a reference model measures no KL: its steps record ``kl`` as null, not the
0.0 the trainer's reply carries for it (docs/controller.md, "Records: measured or unknown")."""

from __future__ import annotations

from pathlib import Path

import pytest

from podrl.config import RunConfig
from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import RecoveredStep, RunStore, StepRecorder
from podrl.controller.service.status import RunState
from podrl.controller.step.batch import StepSamples, TrainBatch
from podrl.controller.step.pod_calls import TrainOutcome
from podrl.v1 import trainer_pb2

# What a trainer answers: with kl_coef 0 its kl is the proto default, 0.0.
REPLY = trainer_pb2.TrainResponse(
    policy_version=1, metrics=trainer_pb2.TrainMetrics(loss=0.5, kl=0.0, grad_norm=2.0)
)
STATS = {
    "reward_mean": 0.5, "reward_max": 1.0, "reward_by_task": {}, "score_errors": 0,
    "score_errors_by_kind": {}, "dropped_samples": 0, "groups": 0, "groups_dropped": 0,
    "groups_dropped_score_errors": 0, "sequences_trained": 0,
}  # fmt: skip


def _recorder(tmp_path: Path, kl_coef: float) -> StepRecorder:
    config = RunConfig.model_validate(
        {"name": "kl", "run_dir": str(tmp_path), "trainer": {"kl_coef": kl_coef}}
    )
    state = RunState("kl", PodTable(60), 1)
    return StepRecorder(config, state, RunStore(tmp_path / "controller.sqlite"))


@pytest.mark.parametrize(("kl_coef", "recorded"), [(0.0, None), (0.05, 0.0)])
def test_a_trained_step_records_kl_only_when_it_was_measured(
    tmp_path: Path, kl_coef: float, recorded: float | None
) -> None:
    recorder = _recorder(tmp_path, kl_coef)
    outcome = TrainOutcome(REPLY, metrics_known=True, sends=1, replies={"pod-0": REPLY})
    recorder.record(1, 1, {}, StepSamples(items=[]), TrainBatch([], STATS), outcome, "kl:1", {})
    stored = recorder.store.step(1)
    assert stored is not None
    assert stored.metrics["kl"] == recorded
    # The other figures are measured either way; an unmeasured KL is not a lost value.
    assert stored.metrics["loss"] == 0.5 and stored.metrics["grad_norm"] == 2.0
    assert stored.metrics["metrics_unknown"] is False


@pytest.mark.parametrize(("kl_coef", "recorded"), [(0.0, None), (0.05, 0.0)])
def test_a_recovered_step_records_kl_only_when_it_was_measured(
    tmp_path: Path, kl_coef: float, recorded: float | None
) -> None:
    recorder = _recorder(tmp_path, kl_coef)
    record = recorder.record_recovered(RecoveredStep(1, 1, {}, [], "kl:ab:1:1", REPLY))
    assert record.metrics["kl"] == recorded and record.metrics["loss"] == 0.5
