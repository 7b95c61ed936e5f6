"""A run whose task names an environment, on a real local pod (`podrl run`'s launcher): the
launcher starts the environment service with the pod, the step plays the task's episodes,
the trainer trains them with their masks, samples.jsonl shows each episode's turns, and the
status, the metrics and /v1/episodes/latest show the episodes played."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from podrl.cli.local_cluster import LocalCluster
from podrl.common.processes import free_port
from podrl.config import load_config
from tests.controller.episode_environments import TURNS

pytestmark = pytest.mark.slow

STEPS = 2


def _status(cluster: LocalCluster) -> dict[str, Any]:
    try:
        return httpx.get(f"{cluster.rest_url}/v1/status", timeout=5).json()
    except httpx.HTTPError:
        return {}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_of_episodes_trains_them_and_records_their_turns(tmp_path: Path, mode: str) -> None:
    config = {
        "name": "episodes",
        "run_dir": str(tmp_path / "run"),
        "device": "cpu",
        "controller": {"heartbeat_interval_seconds": 0.5, "heartbeat_timeout_seconds": 3},
        "environments": {
            "plugins": {"parity": "tests.controller.episode_environments:Parity"},
            "grpc_port": free_port(),
        },
        "tasks": {
            "definitions": [
                {
                    "name": "tool",
                    "source": {"kind": "procedural", "generator": "add"},
                    "rewards": [{"name": "exact_match"}],
                    "environment": "parity",
                    "turn_stop": ["]"],
                }
            ]
        },
        "loop": {
            "mode": mode,
            "steps": STEPS,
            "prompts_per_step": 2,
            "sampling": {"n": 4, "max_tokens": 6, "temperature": 1.0},
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    loaded = load_config(path, env=dict(os.environ))
    cluster = LocalCluster(loaded, str(path))
    assert "environments" in cluster.pod_services
    cluster.start()
    try:
        cluster.wait_ready(timeout=400)
        assert cluster.child("environments").grpc_service == "podrl.v1.Environment"
        deadline = time.monotonic() + 600
        while (status := _status(cluster)).get("phase") not in ("finished", "failed"):
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        steps = httpx.get(f"{cluster.rest_url}/v1/steps", timeout=5).json()
        latest = httpx.get(f"{cluster.rest_url}/v1/episodes/latest", timeout=5).json()
        prometheus = httpx.get(f"{cluster.rest_url}/metrics", timeout=5).text
    finally:
        cluster.stop(grace=30, controller_first=True)
    assert status["phase"] == "finished", status.get("error")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for record in steps:  # two prompts x four episodes of three turns, one tool call each
        assert record["metrics"]["episodes"] == 8
        assert record["metrics"]["episode_turns_mean"] == TURNS
        assert record["metrics"]["tool_calls"] == 8 * TURNS
    trained = [s["metrics"] for s in steps if s["metrics"]["trained"]]
    assert trained, steps
    for metrics in trained:
        # The trainer compares its logprobs with the generator's on sampled tokens only: a
        # reply token (the generator's 0.0 stands there) would differ by its whole logprob.
        # (Async: a batch may be one version stale, so the two policies differ a little.)
        assert metrics["logprob_diff_max"] < (0.01 if mode == "sync" else 0.5), metrics
    rows = [
        json.loads(line) for line in (loaded.run_dir / "samples.jsonl").read_text().splitlines()
    ]
    assert len(rows) == STEPS * 2 * 4
    for row in rows:
        assert len(row["turns"]) == TURNS and row["reward"] in (0.0, 1.0)
        assert row["completion"] == "".join(t["action"] + t["observation"] for t in row["turns"])
    assert any(row["trained"] for row in rows)
    # The live figures, as the status and the metrics show them once the run ended (async
    # mode's producer may have played a step more than were trained).
    episodes = status["episodes"]
    assert episodes["in_flight"] == 0 and episodes["failed"] == 0
    assert episodes["finished"] >= STEPS * 2 * 4 and episodes["finished"] % 8 == 0
    assert episodes["turns"] == episodes["tool_calls"] == episodes["finished"] * TURNS
    assert episodes["environment_seconds_mean"] > 0
    assert f"podrl_episode_turns_total {float(episodes['turns'])}" in prometheus
    assert [len(t["action"]["text"]) > 0 for t in latest["turns"]] == [True] * TURNS
    assert latest["ended"] == "done" and latest["reward"] in (0.0, 1.0)
    assert [t["observation"]["text"] for t in latest["turns"]] == [
        "\n[reply 1]\n",
        "\n[reply 2]\n",
        "",
    ]
