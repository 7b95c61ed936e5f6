"""The GRPO loop end to end against one fake pod (trainer and generator stand-ins over real
gRPC, tests/controller/fake_workers.py) and the REAL grader with real reward plug-ins.

Each test runs ``GrpoLoop.run`` to its end and checks what the run left behind: the step
records, samples.jsonl, summary.json, and what the fake trainer was asked to train.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from prometheus_client import REGISTRY

from podrl.v1 import common_pb2
from tests.controller.fake_pod_loop import DEADLINE, GROUP, PROMPTS, RunLoop
from tests.controller.fake_workers import FakePod, TrainFault


def _metric(name: str, **labels: str) -> float:
    """The controller's Prometheus value (what /metrics serves), 0 when never set."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_finished_run_says_finished_everywhere(pod: FakePod, run_loop: RunLoop) -> None:
    run = run_loop(pod)
    assert run["state"].phase == "finished", run["state"].error
    # before: the summary was written while the phase still said "checkpoint".
    assert run["summary"]["phase"] == "finished"
    assert run["summary"]["steps"] == run["summary"]["steps_trained"] == 3
    assert [s.step for s in run["steps"]] == [1, 2, 3]
    assert pod.trainer.version == pod.generator.version == 3
    assert run["summary"]["final_reward_mean"] == pytest.approx(0.5)  # half the samples right


def test_a_failed_checkpoint_is_reported_and_the_next_checkpoint_step_saves_again(
    pod: FakePod, run_loop: RunLoop
) -> None:
    # The save at step 2 fails as a full disk does (the trainer answers RESOURCE_EXHAUSTED);
    # the run goes on, and the save at its end (step 3) works.
    pod.trainer.save_faults = [grpc.StatusCode.RESOURCE_EXHAUSTED, None]
    run = run_loop(pod)
    assert run["state"].phase == "finished"
    assert [s.step for s in run["steps"]] == [1, 2, 3]
    failure = run["state"].view().last_checkpoint_error
    assert failure["step"] == 2
    assert failure["error"].startswith("RESOURCE_EXHAUSTED: [Errno 28] No space left on device")
    assert run["summary"]["last_checkpoint_error"] == failure
    assert run["summary"]["checkpoint"]["step"] == 3  # the later save is the good one
    assert sorted(p.name for p in pod.trainer.checkpoint_dir.iterdir()) == ["step-00000003"]


def test_a_lost_train_reply_records_the_samples_of_the_applied_batch(
    pod: FakePod, run_loop: RunLoop
) -> None:
    """The old loop regenerated the step after a Train timeout and recorded the second
    attempt's samples, while the trainer had applied the first attempt's."""
    pod.trainer.faults = [TrainFault(), TrainFault(delay_before_apply=DEADLINE * 1.5)]
    run = run_loop(pod)
    assert run["state"].phase == "finished", run["state"].error
    assert len(pod.trainer.applied) == 3 and pod.trainer.version == 3
    # Every prompt was generated once: step 2 was not regenerated.
    assert len(pod.generator.generated) == len(set(pod.generator.generated)) == 3 * PROMPTS
    step2 = run["steps"][1]
    assert step2.metrics["train_sends"] >= 2
    applied_ids = {s.sample_id for s in pod.trainer.applied[1].sequences}
    recorded = {
        f"{row['prompt_id']}#{row['index']}"
        for row in run["samples"]
        if row["step"] == 2 and row["trained"]
    }
    assert recorded == applied_ids
    assert step2.metrics["loss"] == pytest.approx(1.5)  # the applied batch's own reply
    assert step2.metrics["metrics_unknown"] is False


def test_a_trainer_without_batch_ids_records_unknown_not_zero(
    pod: FakePod, run_loop: RunLoop
) -> None:
    """The old loop stored loss = grad_norm = ... = 0.0 for a step whose reply was lost."""
    pod.trainer.keeps_batch_ids = False
    pod.trainer.faults = [TrainFault(), TrainFault(delay_before_apply=DEADLINE * 1.5)]
    run = run_loop(pod)
    assert run["state"].phase == "finished", run["state"].error
    step2 = run["steps"][1].metrics
    assert step2["trained"] is True and step2["metrics_unknown"] is True
    assert step2["loss"] is None and step2["grad_norm"] is None and step2["kl"] is None
    # The drift figures too; an unknown figure is outside no band.
    for name in ("mismatch_kl", "update_ratio", "is_weight_max", "clip_fraction_low"):
        assert step2[name] is None, name
    assert step2["drift_warnings"] == []
    # The batch itself is known: its samples' ages are.
    assert step2["behaviour_age_max"] == 0
    assert run["steps"][0].metrics["loss"] == pytest.approx(0.5)
    assert run["summary"]["steps_with_unknown_metrics"] == 1


def test_score_errors_are_left_out_of_training_and_counted(pod: FakePod, run_loop: RunLoop) -> None:
    pod.generator.complete = lambda prompt, index: (
        "RAISE" if index == 3 else (prompt.reference if index % 2 == 0 else "wrong")
    )
    errors_before = _metric("podrl_score_errors_total", error="SCORE_ERROR_EXCEPTION")
    dropped_before = _metric("podrl_dropped_samples_total")
    run = run_loop(pod)
    assert run["state"].phase == "finished", run["state"].error
    failed = [row for row in run["samples"] if row["score_error"]]
    assert len(failed) == 3 * PROMPTS
    assert all(row["reward"] is None and not row["trained"] for row in failed)
    assert all("this reward function is broken" in row["score_error_message"] for row in failed)
    for request in pod.trainer.applied:
        assert not [s for s in request.sequences if s.sample_id.endswith("#3")]
        assert len(request.sequences) == PROMPTS * (GROUP - 1)
    for step in run["steps"]:
        assert step.metrics["score_errors"] == step.metrics["dropped_samples"] == PROMPTS
        # Of the 3 valid samples, indices 0 and 2 are right: 2/3, not 2/4 or a fallback mean.
        assert step.metrics["reward_mean"] == pytest.approx(2 / 3)
    assert run["summary"]["score_errors"] == 3 * PROMPTS
    # The status page and /metrics show them too.
    assert run["state"].view().last_step_metrics["score_errors"] == PROMPTS
    errors = _metric("podrl_score_errors_total", error="SCORE_ERROR_EXCEPTION")
    assert errors - errors_before == 3 * PROMPTS
    assert _metric("podrl_dropped_samples_total") - dropped_before == 3 * PROMPTS
    assert _metric("podrl_step_score_errors") == PROMPTS


def test_a_reward_that_raises_on_every_item_fails_the_run_naming_its_error(
    pod: FakePod, run_loop: RunLoop
) -> None:
    """The old loop trained nothing (all-equal fallback rewards) and called it finished."""
    pod.generator.complete = lambda prompt, index: "RAISE"
    run = run_loop(pod)
    assert run["state"].phase == "failed"
    error = run["state"].error
    assert "step 1 failed 2 times" in error
    assert "every sample failed" in error and "this reward function is broken" in error
    assert run["summary"]["phase"] == "failed"
    assert pod.trainer.applied == []


def test_a_lost_database_resumes_from_the_checkpoint_state(
    pod: FakePod, run_loop: RunLoop, tmp_path: Path
) -> None:
    """With controller.sqlite deleted (and the last checkpoint with it), the restarted run
    goes on from the controller state in the newest checkpoint left: no prompt twice, none
    skipped, and samples.jsonl holds each step once."""
    first = run_loop(pod, steps=5)  # checkpoints after steps 2, 4 and 5
    assert first["state"].phase == "finished", first["state"].error
    run_dir = tmp_path / "run"
    for name in ("controller.sqlite", "controller.sqlite-wal", "controller.sqlite-shm"):
        (run_dir / name).unlink(missing_ok=True)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert checkpoints == ["step-00000002", "step-00000004", "step-00000005"]
    for path in (run_dir / "checkpoints" / "step-00000005").iterdir():
        path.unlink()
    (run_dir / "checkpoints" / "step-00000005").rmdir()
    # The trainer restarts too (version 0, its checkpoints on disk), the generator keeps v5.
    restarted = FakePod(run_dir / "checkpoints")
    restarted.generator.version = pod.generator.version
    try:
        second = run_loop(restarted, steps=7)
    finally:
        restarted.stop()
    assert second["state"].phase == "finished", second["state"].error
    assert [s.step for s in second["steps"]] == [5, 6, 7]
    assert restarted.trainer.version == restarted.generator.version == 4 + 3
    steps = [row["step"] for row in second["samples"]]
    assert steps == sorted(steps), "samples.jsonl repeats a step"
    by_step: dict[int, list[str]] = {}
    for row in second["samples"]:
        if row["index"] == 0:
            by_step.setdefault(row["step"], []).append(row["prompt_id"])
    assert sorted(by_step) == list(range(1, 8))
    prompts = [pid for step in sorted(by_step) for pid in by_step[step]]
    assert prompts == [f"copy/{i}" for i in range(7 * PROMPTS)]
    # Step 5 was redone with the prompts it had the first time.
    assert restarted.generator.generated[:PROMPTS] == pod.generator.generated[4 * PROMPTS :]


def test_sample_rows_say_which_version_sampled_them(pod: FakePod, run_loop: RunLoop) -> None:
    run = run_loop(pod)
    for row in run["samples"]:
        assert row["policy_version"] == row["step"] - 1
        assert row["finish_reason"] == common_pb2.FinishReason.Name(common_pb2.FINISH_REASON_STOP)


# -- loop.generator_memory: sleep_during_train (the generator sleeps while its trainer trains) --
SLEEP = {"generator_memory": "sleep_during_train"}


def _step_calls(calls: list[str]) -> list[list[str]]:
    """The generator's calls cut into steps, each ending with its ApplyWeights."""
    steps, current = [], []
    for call in calls:
        current.append(call)
        if call == "ApplyWeights":
            steps.append(current)
            current = []
    return steps


def test_generators_sleep_during_train_and_wake_before_the_sync(
    pod: FakePod, run_loop: RunLoop
) -> None:
    run = run_loop(pod, **SLEEP)
    assert run["state"].phase == "finished", run["state"].error
    assert pod.trainer.trained_while_asleep == [True, True, True]
    # Each step: generate, sleep, (Train), wake, apply; Generate never meets a sleeping engine.
    assert _step_calls(pod.generator.calls) == [["Generate", "Sleep", "WakeUp", "ApplyWeights"]] * 3
    phases = [step.metrics["phase_seconds"] for step in run["steps"]]
    assert all({"sleep", "wake", "train", "sync"} <= set(p) for p in phases), phases


def test_resident_generators_never_sleep(pod: FakePod, run_loop: RunLoop) -> None:
    run = run_loop(pod)
    assert run["state"].phase == "finished", run["state"].error
    assert pod.trainer.trained_while_asleep == [False, False, False]
    assert "Sleep" not in pod.generator.calls and "WakeUp" not in pod.generator.calls


def test_a_train_not_applied_wakes_the_generator_before_the_retry(
    pod: FakePod, run_loop: RunLoop
) -> None:
    pod.trainer.faults = [TrainFault(abort_before_apply=grpc.StatusCode.INTERNAL)]
    run = run_loop(pod, **SLEEP)
    assert run["state"].phase == "finished", run["state"].error
    assert [s.step for s in run["steps"]] == [1, 2, 3]
    # Step 1's first attempt slept and failed in Train; its retry's align woke the generator
    # before generating again (a sleeping generator refuses Generate).
    assert pod.generator.calls[:6] == ["Generate", "Sleep", "WakeUp", "Generate", "Sleep", "WakeUp"]
    assert pod.trainer.trained_while_asleep == [True, True, True, True]


def test_a_failed_sleep_retries_the_step_without_training(pod: FakePod, run_loop: RunLoop) -> None:
    pod.generator.sleep_fails = 1
    run = run_loop(pod, **SLEEP)
    assert run["state"].phase == "finished", run["state"].error
    assert len(pod.trainer.received) == 3  # the failed attempt never reached Train
    assert pod.generator.calls[:3] == ["Generate", "Sleep", "Generate"]
    assert _metric("podrl_step_failures_total", phase="sleep") >= 1


def test_a_failed_wake_is_retried_on_its_own_without_training_again(
    pod: FakePod, run_loop: RunLoop
) -> None:
    pod.generator.wake_fails = 1
    run = run_loop(pod, **SLEEP)
    assert run["state"].phase == "finished", run["state"].error
    assert len(pod.trainer.received) == 3  # step 1 was trained once, not redone
    assert _step_calls(pod.generator.calls)[0] == [
        "Generate",
        "Sleep",
        "WakeUp",
        "WakeUp",
        "ApplyWeights",
    ]
    assert _metric("podrl_step_failures_total", phase="wake") >= 1


def test_a_pod_synced_at_a_step_is_not_asked_again_at_the_next_step_boundary(
    pod: FakePod, run_loop: RunLoop
) -> None:
    # The first step's align acknowledges version 0; each sync acknowledges its version. The
    # align after a sync that succeeded knows the trainer published that version and the
    # generator applied it, so it asks neither again (it used to acknowledge it a second time).
    result = run_loop(pod)
    assert [s.policy_version for s in result["steps"]] == [1, 2, 3]
    assert pod.trainer.acknowledged == [0, 1, 2, 3]


IN_BAND = {"mismatch_kl": 0.001, "update_ratio": 1e-5, "logprob_diff_mean": 0.01}


def test_a_step_inside_the_drift_band_records_its_figures_and_warns_nothing(
    pod: FakePod, run_loop: RunLoop
) -> None:
    pod.trainer.train_metrics = {**IN_BAND, "is_weight_max": 1.2, "clip_fraction_dual": 0.05}
    run = run_loop(pod)
    assert run["state"].phase == "finished", run["state"].error
    for record in run["steps"]:
        figures = record.metrics
        assert figures["mismatch_kl"] == pytest.approx(0.001)
        assert figures["update_ratio"] == pytest.approx(1e-5)
        assert figures["is_weight_max"] == pytest.approx(1.2)
        assert figures["clip_fraction_dual"] == pytest.approx(0.05)
        # Sync mode: every sample comes from the version that trains on it.
        assert figures["behaviour_age_mean"] == figures["behaviour_age_max"] == 0
        assert figures["drift_warnings"] == []
    assert run["state"].view().warnings == []
    assert _metric("podrl_train_mismatch_kl") == pytest.approx(0.001)
    assert _metric("podrl_train_update_ratio") == pytest.approx(1e-5)


@pytest.mark.parametrize(
    ("reported", "figure", "side", "knob"),
    [
        ({**IN_BAND, "mismatch_kl": 1.9}, "mismatch_kl", "high", "trainer.off_policy.mask"),
        ({**IN_BAND, "update_ratio": 0.3}, "update_ratio", "high", "lower trainer.lr"),
        ({**IN_BAND, "update_ratio": 0.0}, "update_ratio", "low", "raise trainer.lr"),
    ],
)
def test_a_step_outside_the_drift_band_warns_naming_the_knob(
    pod: FakePod,
    run_loop: RunLoop,
    caplog: pytest.LogCaptureFixture,
    reported: dict[str, float],
    figure: str,
    side: str,
    knob: str,
) -> None:
    pod.trainer.train_metrics = reported
    before = _metric("podrl_drift_warnings_total", figure=figure, side=side)
    with caplog.at_level("WARNING", logger="podrl.controller.records.recorder"):
        run = run_loop(pod)
    assert run["state"].phase == "finished", run["state"].error  # a warning stops nothing
    warnings = run["state"].view().warnings
    assert [(w["step"], w["figure"], w["side"]) for w in warnings] == [
        (step, figure, side) for step in (1, 2, 3)
    ]
    assert all(knob in w["knobs"] and knob in w["message"] for w in warnings)
    assert [w["step"] for w in run["steps"][1].metrics["drift_warnings"]] == [2]
    logged = [r.getMessage() for r in caplog.records if "policy drift" in r.getMessage()]
    assert len(logged) == 3 and f"loop.drift_warnings.{figure}_" in logged[0], logged
    assert knob in logged[0]
    assert _metric("podrl_drift_warnings_total", figure=figure, side=side) == before + 3


def test_the_drift_band_is_configurable(pod: FakePod, run_loop: RunLoop) -> None:
    pod.trainer.train_metrics = {**IN_BAND, "mismatch_kl": 1.9}
    run = run_loop(pod, drift_warnings={"mismatch_kl_max": 2.0})
    assert run["state"].view().warnings == []
