"""Fixtures for the weight-transfer tests: a gloo trainer in real processes, a one-process one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from podrl.common.processes import free_port
from podrl.v1 import weights_pb2
from tests.weights.manifest_cases import Trainer


class GlooTrainer:
    """Handle on the spawned 4-rank trainer of tests/weights/gloo_publisher.py."""

    def __init__(self, out_dir: Path) -> None:
        from tests.weights.gloo_publisher import WORLD, run_rank

        self.out_dir = out_dir
        self.context = mp.start_processes(
            run_rank,
            args=(free_port(), str(out_dir)),
            nprocs=WORLD,
            join=False,
            start_method="spawn",
        )

    def manifest(self, mesh_kind: str, version: int, timeout: float = 300.0):
        path = self.out_dir / f"manifest-{mesh_kind}-{version}.bin"
        deadline = time.monotonic() + timeout
        while not path.exists():
            # join() raises if a rank died, so a broken trainer fails fast.
            if self.context.join(timeout=0.05):
                raise RuntimeError("trainer exited before publishing")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {path.name}")
        return weights_pb2.WeightManifest.FromString(path.read_bytes())

    def acknowledge(self, mesh_kind: str, version: int) -> None:
        (self.out_dir / f"ack-{mesh_kind}-{version}").touch()

    def stop(self) -> None:
        from tests.weights.gloo_publisher import MESH_KINDS

        for mesh_kind in MESH_KINDS:  # unblock ranks whose test failed before acknowledging
            self.acknowledge(mesh_kind, 1)
        (self.out_dir / "done").touch()
        for process in self.context.processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


@pytest.fixture(autouse=True)
def _few_threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gloo_trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GlooTrainer]:
    trainer = GlooTrainer(tmp_path_factory.mktemp("gloo-trainer"))
    yield trainer
    trainer.stop()


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    """A one-process trainer publishing a tiny Qwen3 with the test weights key."""
    trainer = Trainer()
    yield trainer
    trainer.publisher.close()
