"""The worker side without an engine: a worker reads its tensor-parallel rank once, when the
engine starts (``podrl_describe``), so that the receiver its first apply builds slices by it
without calling into vLLM's internals (a full-manifest sync then runs no ``vllm_compat``)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from podrl.generator import vllm_compat
from podrl.generator.worker_extension import PodrlWorkerExtension
from podrl.models.tiny import make_tiny_model


class Worker(PodrlWorkerExtension):
    """What the extension reads of vLLM's worker: its model, config and device."""

    def __init__(self, model_dir: Path) -> None:
        self.model_runner = SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2))
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(model=str(model_dir), dtype=torch.float32)
        )
        self.device = torch.device("cpu")


def test_the_first_apply_builds_its_receiver_without_reading_vllms_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = Worker(make_tiny_model(tmp_path / "model"))
    monkeypatch.setattr(vllm_compat, "tensor_parallel_rank_and_size", lambda: (0, 1))
    assert worker.podrl_describe("in_place")["apply_mode"] == "in_place"

    def not_on_an_apply() -> tuple[int, int]:
        raise AssertionError("an apply read vLLM's tensor-parallel rank")

    monkeypatch.setattr(vllm_compat, "tensor_parallel_rank_and_size", not_on_an_apply)
    receiver = worker._podrl_get_receiver("in_place", "trainer-1", copy_streams=1)
    assert receiver is worker._podrl_get_receiver("in_place", "trainer-1", copy_streams=1)
