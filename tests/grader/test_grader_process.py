"""The grader as its own process (``python -m podrl.grader``): scores the demo task's items end to
end from the task source, and on SIGTERM exits 0 and takes its worker processes with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podrl.config.tasks import TasksConfig
from podrl.tasks import build_task_source
from podrl.v1 import grader_pb2, grader_pb2_grpc
from tests.foundation.run_secret import authed_channel
from tests.grader.conftest import free_port

DEMO_TASK = {
    "name": "add",
    "source": {"kind": "procedural", "generator": "add"},
    "template": "{question}",
    "target_template": "{answer}\n",
    "rewards": [
        {"name": "exact_match", "weight": 0.5, "params": {"stop": "\n"}},
        {"name": "char_match", "weight": 0.5, "params": {"stop": "\n"}},
    ],
}

# A plug-in task: its rewards run in the worker pool (DEMO_TASK's built-ins in the grader).
PLUGIN_TASK = {
    "name": "plugin",
    "source": {"kind": "procedural", "generator": "add"},
    "rewards": [{"name": "tests.grader.faulty_rewards:behaves_by_completion"}],
}


@pytest.fixture
def grader_process(tmp_path: Path):
    port = free_port()
    config = {
        "controller": {"grpc_port": free_port()},
        "grader": {"grpc_port": port, "metrics_port": 0, "workers": 2},
        "tasks": {"definitions": [DEMO_TASK, PLUGIN_TASK]},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PODRL_LOG__FORMAT": "text", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "podrl.grader", "--config", str(path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    channel = authed_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        yield process, channel
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def test_scores_task_items_and_stops_cleanly_on_sigterm(grader_process) -> None:
    process, channel = grader_process
    items = build_task_source(TasksConfig.model_validate({"definitions": [DEMO_TASK]}))
    drawn = items.next_prompts(20)
    right = [item.score_item(item.target + "junk after the stop", f"{item.id}#0") for item in drawn]
    wrong = [item.score_item("x\n", f"{item.id}#1") for item in drawn]
    plugin = grader_pb2.ScoreItem(id="plugin#0", task="plugin", completion="7", reference="7")
    reply = grader_pb2_grpc.GraderStub(channel).Score(
        grader_pb2.ScoreRequest(items=[*right, *wrong, plugin]), timeout=30
    )
    assert [s.id for s in reply.scores] == [i.id for i in [*right, *wrong, plugin]]
    assert all(s.error == grader_pb2.SCORE_ERROR_NONE for s in reply.scores)
    assert [s.reward for s in reply.scores[:20]] == [1.0] * 20
    assert [s.reward for s in reply.scores[20:40]] == [0.0] * 20
    assert reply.scores[40].reward == 1.0

    status = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="podrl.v1.Grader"), timeout=5
    )
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    descendants = psutil.Process(process.pid).children(recursive=True)
    assert len(descendants) >= 3  # the fork server and two workers (for the plug-in task)

    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0, process.stderr.read()
    assert time.monotonic() - start < 15
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert not alive
