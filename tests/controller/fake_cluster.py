"""Several fake pods (tests/controller/fake_workers.py) registered with a real pod table, the
loop run over them against the REAL grader, and checks of what the run left (the ``cluster``
fixture is in tests/controller/conftest.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import RunStore
from podrl.controller.service.main import build_loop
from podrl.controller.service.status import RolloutView, RunState
from podrl.controller.step.pod_calls import WorkerClients
from podrl.tasks import build_task_source
from podrl.v1 import controller_pb2, trainer_pb2, trainer_pb2_grpc
from tests.controller.fake_pod_loop import GROUP, PROMPTS, loop_config
from tests.controller.fake_workers import FakePod, FakeReplicaGroup
from tests.foundation.run_secret import credentials

STEPS = 3
COMPONENTS = (
    controller_pb2.COMPONENT_GENERATOR,
    controller_pb2.COMPONENT_GRADER,
    controller_pb2.COMPONENT_TRAINER,
)


class Cluster:
    """Fake pods registered with a real pod table (their grader is the shared real one)."""

    def __init__(self, tmp_path: Path, grader: str, group: FakeReplicaGroup | None) -> None:
        self.tmp_path = tmp_path
        self.grader = grader
        self.group = group
        self.table = PodTable(heartbeat_timeout_seconds=3600)
        self.pods: dict[str, FakePod] = {}

    def add(self, pod_id: str) -> FakePod:
        pod = FakePod(self.tmp_path / "run" / "checkpoints", pod_id, group=self.group)
        self.pods[pod_id] = pod
        for component in COMPONENTS:
            address = self.grader if component == controller_pb2.COMPONENT_GRADER else pod.address
            self.table.register(pod_id, component, address, f"{pod_id}-incarnation")
        return pod

    def drain(self, pod_id: str) -> None:
        """As SIGTERM: every process of the pod tells the controller it is draining."""
        for component in COMPONENTS:
            self.table.drain(pod_id, component, f"{pod_id}-incarnation")

    def stop(self) -> None:
        for pod in self.pods.values():
            pod.stop()

    def run(
        self,
        steps: int = STEPS,
        on_step: Callable[[int], None] | None = None,
        stop: threading.Event | None = None,
        task: dict[str, Any] | None = None,
        **loop: Any,
    ) -> dict[str, Any]:
        """``loop``: more fields of the loop section (mode, max_staleness, ...); ``task``: of
        the task definition."""
        run_dir = self.tmp_path / "run"
        port = int(self.grader.rsplit(":", 1)[1])
        config = loop_config(run_dir, port, task=task, steps=steps, **loop)
        state = RunState(
            config.name, self.table, 1, config.loop.steps, rollout=RolloutView.of(config.loop)
        )
        store = RunStore(run_dir / "controller.sqlite")
        clients = WorkerClients(config.grpc, credentials())  # the real grader checks them
        source = build_task_source(config.tasks)
        stop = stop or threading.Event()
        loop = build_loop(config, state, store, clients, source, self.table, stop, 0.05)
        if on_step is not None:
            record = loop.recorder.record

            def recorded(step: int, *args: Any, **kwargs: Any) -> Any:
                result = record(step, *args, **kwargs)
                on_step(step)
                return result

            loop.recorder.record = recorded  # type: ignore[method-assign]
        try:
            loop.run()
            steps_done = store.steps()
        finally:
            clients.close()
            store.close()
        samples = [
            json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()
        ]
        return {"state": state, "steps": steps_done, "samples": samples, "table": self.table}


def digest(address: str) -> trainer_pb2.ParametersDigestResponse:
    """The fake trainer's digest of its parameters."""
    with grpc.insecure_channel(address) as channel:
        return trainer_pb2_grpc.TrainerStub(channel).ParametersDigest(
            trainer_pb2.ParametersDigestRequest(), timeout=5
        )


def check_every_prompt_once(samples: list[dict[str, Any]], steps: int) -> None:
    """Each prompt in exactly one step, with one whole group, from one pod."""
    groups: dict[str, set[tuple[int, str | None]]] = {}
    counts: dict[str, int] = {}
    for row in samples:
        groups.setdefault(row["prompt_id"], set()).add((row["step"], row["pod"]))
        counts[row["prompt_id"]] = counts.get(row["prompt_id"], 0) + 1
    assert sorted(groups) == sorted(f"copy/{i}" for i in range(steps * PROMPTS))
    assert all(len(where) == 1 for where in groups.values()), groups
    assert set(counts.values()) == {GROUP}
