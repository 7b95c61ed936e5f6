"""Fixtures of the trainer tests: the tiny model and a launcher for gloo ranks."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from podrl.models.tiny import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(world: int, env: dict[str, str], plan: list[list], out: Path) -> list:
    """Run ``rank_worker.scenario`` on ``world`` spawned gloo ranks; rank 0's results."""
    import rank_worker

    mp.start_processes(
        rank_worker.scenario,
        args=(world, free_port(), env, plan, str(out)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return json.loads(out.read_text())
