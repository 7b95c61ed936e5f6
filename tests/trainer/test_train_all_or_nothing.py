"""Train is all or nothing over every rank (2 FSDP2 ranks on gloo, faults injected on rank 1):
a rank that fails before the optimizer step leaves every rank's weights and version as they
were, bit for bit; a rank that fails after it still counts the step as applied on every rank,
with the same weights a fault-free run has."""

from __future__ import annotations

import json

import pytest

from tests.trainer.rank_worker import config_env, run_ranks_each

pytestmark = pytest.mark.slow

METRICS = ("loss", "pg_loss", "entropy", "ratio_mean", "grad_norm", "tokens", "logprob_diff_max")


def _fault(point: str) -> list:
    return ["faults", json.dumps([{"point": point, "action": "raise", "rank": 1, "times": 1}])]


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("all-or-nothing")
    env = config_env(str(tiny_model), str(tmp), dp_shard=2)
    reference = run_ranks_each(
        2, env, [["state"], ["train", 1], ["state"], ["train", 2], ["state"]], tmp / "ref.json"
    )
    faulted = run_ranks_each(
        2,
        env,
        [
            ["state"],
            _fault("trainer.before_optimizer_step"),
            ["try_train", 1],  # 2: rank 1 fails after the collectives, before the step
            ["state"],
            _fault("trainer.after_optimizer_step"),
            ["try_train", 1],  # 5: rank 1 fails right after its optimizer step
            ["state"],
            ["try_train", 2],  # 7: the next step
            ["state"],
        ],
        tmp / "faulted.json",
    )
    return reference, faulted


def test_a_rank_failing_before_the_step_changes_nothing_on_any_rank(runs):
    reference, faulted = runs
    for rank in (0, 1):
        error = faulted[rank][2]["error"]
        assert error.startswith("StepAbortedError"), error
        assert "rank(s) [1] failed" in error and "unchanged on every rank" in error
        before, after = faulted[rank][0], faulted[rank][3]
        assert after["version"] == 0
        assert after["digest"] == before["digest"] == reference[rank][0]["digest"], rank
    # The injected error itself is named on the rank where it happened.
    assert "InjectedFaultError" in faulted[1][2]["error"]


def test_a_rank_failing_after_the_step_still_applies_it_on_every_rank(runs):
    reference, faulted = runs
    for rank in (0, 1):
        applied = faulted[rank][5]
        assert "error" not in applied, applied
        for key in METRICS:  # the reply carries the step's metrics, as without the fault
            assert applied[key] == reference[rank][1][key], (rank, key)
        state = faulted[rank][6]
        assert state["version"] == 1, rank
        # Exactly one update, the same as a fault-free run's (not zero, not two).
        assert state["digest"] == reference[rank][2]["digest"] != reference[rank][0]["digest"]


def test_the_next_step_after_both_faults_trains_like_a_fault_free_run(runs):
    reference, faulted = runs
    for rank in (0, 1):
        assert faulted[rank][7]["loss"] == reference[rank][3]["loss"]
        state = faulted[rank][8]
        assert state["version"] == 2
        assert state["digest"] == reference[rank][4]["digest"], rank
