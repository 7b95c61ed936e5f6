"""Fixtures of the trainer tests: the tiny model and a launcher for gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from podrl.models.tiny import make_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
