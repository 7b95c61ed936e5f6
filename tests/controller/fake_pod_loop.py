"""The GRPO loop run to its end against one fake pod (tests/controller/fake_workers.py) and the
REAL grader: its config and the run (fixtures ``grader_address``, ``pod``, ``run_config`` and
``run_loop`` in tests/controller/conftest.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from podrl.common.processes import free_port
from podrl.config import RunConfig
from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import RunStore
from podrl.controller.service.main import build_loop
from podrl.controller.service.status import RolloutView, RunState
from podrl.controller.step.pod_calls import WorkerClients
from podrl.tasks import build_task_source
from podrl.v1 import controller_pb2
from tests.controller.fake_workers import FakePod
from tests.foundation.run_secret import credentials

PROMPTS = 3
GROUP = 4
DEADLINE = 3.0  # every work RPC; the grader scores a step well within it
REWARD = "tests.grader.faulty_rewards:behaves_by_completion"  # "RAISE" raises, else exact match


def loop_config(
    run_dir: Path, grader_port: int, task: dict[str, Any] | None = None, **loop: Any
) -> RunConfig:
    """The fake-pod run's config. ``task``: more fields of the one task definition (e.g. a
    held-out split)."""
    return RunConfig.model_validate(
        {
            "name": "fake-pod",
            "run_dir": str(run_dir),
            "worker_id": "pod-0",
            # Nothing listens there: the grader's registration retries quietly.
            "controller": {"grpc_port": free_port()},
            "grader": {"grpc_port": grader_port, "metrics_port": 0, "workers": 1},
            "grpc": {"long_call_timeout_seconds": DEADLINE},
            "tasks": {
                "definitions": [
                    {
                        "name": "copy",
                        "source": {"kind": "procedural", "generator": "copy"},
                        "rewards": [{"name": REWARD}],
                        **(task or {}),
                    }
                ]
            },
            "loop": {
                "steps": 3,
                "prompts_per_step": PROMPTS,
                "sampling": {"n": GROUP},
                "checkpoint_every": 2,
                "max_step_attempts": 2,
                **loop,
            },
        }
    )


RunLoop = Callable[..., dict[str, Any]]
"""``run_loop(pod, **loop)``: the run's state, step records, samples and summary."""
ConfigFor = Callable[..., RunConfig]
"""``config_for(run_dir, grader_port, **loop)``: the run config (``loop_config`` by default)."""


def run_fake_pod_loop(
    pod: FakePod, run_dir: Path, grader_address: str, config_for: ConfigFor, **loop: Any
) -> dict[str, Any]:
    """Run ``GrpoLoop.run`` to its end against ``pod`` and the real grader; what it left."""
    config = config_for(run_dir, int(grader_address.rsplit(":", 1)[1]), **loop)
    table = PodTable(heartbeat_timeout_seconds=3600)
    for component, address in (
        (controller_pb2.COMPONENT_GENERATOR, pod.address),
        (controller_pb2.COMPONENT_GRADER, grader_address),
        (controller_pb2.COMPONENT_TRAINER, pod.address),
    ):
        table.register("pod-0", component, address, "incarnation-1")
    state = RunState(config.name, table, 1, config.loop.steps, rollout=RolloutView.of(config.loop))
    store = RunStore(run_dir / "controller.sqlite")
    clients = WorkerClients(config.grpc, credentials())  # the real grader checks them
    source = build_task_source(config.tasks)
    # Re-sent at once (backoff 0.05 s): the test waits on real deadlines.
    loop_ = build_loop(config, state, store, clients, source, table, threading.Event(), 0.05)
    try:
        loop_.run()
        steps = store.steps()
    finally:
        clients.close()
        store.close()
    samples_path = run_dir / "samples.jsonl"
    return {
        "state": state,
        "steps": steps,
        "samples": [json.loads(line) for line in samples_path.read_text().splitlines()]
        if samples_path.exists()
        else [],
        "summary": json.loads((run_dir / "summary.json").read_text()),
    }
