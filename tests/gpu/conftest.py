"""GPU tests: skipped without CUDA. Run on the CUDA machine with ``pytest tests/gpu``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from podrl.models.qwen3_shapes import QWEN3_SHAPES

# Real Qwen3-0.6B widths (hidden, heads, KV heads, head dim, vocabulary), two decoder layers:
# every tensor kind of the real model at a size that loads in seconds.
TEST_LAYERS = 2


def qwen3_test_config() -> dict:
    return dict(QWEN3_SHAPES["0.6b"], num_hidden_layers=TEST_LAYERS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine)")
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen3 folder (bf16 safetensors) of :func:`qwen3_test_config`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = tmp_path_factory.mktemp("qwen3-0.6b-2layers")
    config = Qwen3Config(**qwen3_test_config(), max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path
