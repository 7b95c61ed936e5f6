"""``generator.cpu_linear_weights`` (podrl.generator.cpu_linear): with ``plain`` vLLM's CPU GEMM
dispatch keeps a linear layer's weight as loaded and computes with torch's linear, so a write
into that weight is what the layer computes with; ``packed`` keeps vLLM's kernels and their
packed copy. In a fresh interpreter each, through vLLM's own plugin loading, since the plugin
patches vLLM's module."""

from __future__ import annotations

import json

import pytest

from podrl.generator.cpu_linear import CPU_LINEAR_ENV
from tests.generator.fresh_interpreter import run_with

#: A linear layer through vLLM's CPU post-load dispatch, then a new weight written in place.
PROBE = """
import json, torch
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.layers import utils
layer = torch.nn.Module()
layer.weight = torch.nn.Parameter(torch.randn(64, 64), requires_grad=False)
utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
x = torch.randn(4, 64)
kept = layer.weight.numel() > 0
if kept:
    new = torch.randn(64, 64)
    layer.weight.data.copy_(new)  # what an in-place apply does
    out = utils.cpu_unquantized_gemm(layer, x, layer.weight)
    follows = bool(torch.allclose(out, x @ new.t(), atol=1e-5))
else:
    follows = False
print(json.dumps({"kept": kept, "follows_the_write": follows}))
"""


def _probe(value: str | None) -> dict[str, bool]:
    return json.loads(run_with(CPU_LINEAR_ENV, value, PROBE).strip().splitlines()[-1])


def test_plain_weights_are_kept_and_a_write_into_them_is_what_the_layer_computes() -> None:
    assert _probe("plain") == {"kept": True, "follows_the_write": True}


@pytest.mark.parametrize("value", [None, "packed", "fast"])
def test_otherwise_vllm_packs_the_weight_and_removes_it(value: str | None) -> None:
    assert _probe(value) == {"kept": False, "follows_the_write": False}
