"""Trainer mesh x generator TP rank x dtype: every target tensor equals the full source tensor.

The trainers are real gloo processes holding FSDP2 / TP / FSDP2xTP DTensor parameters of a
small Qwen3; the receivers run in this process and map the trainers' shared memory.
"""

from __future__ import annotations

import pytest
import torch

from podrl.weights import ModelDescription, WeightReceiver, vllm_layout
from tests.weights.gloo_publisher import MESH_KINDS, WORLD
from tests.weights.reference_layout import expected_vllm_tensors
from tests.weights.tiny_qwen3 import CONFIG, full_params

DTYPES = (torch.float32, torch.bfloat16)
GENERATOR_LAYOUTS = [(1, 0), (2, 0), (2, 1)]


def _receivers(description: ModelDescription) -> dict[tuple, WeightReceiver]:
    receivers = {}
    for dtype in DTYPES:
        receivers[("hf", 1, 0, dtype)] = WeightReceiver(description, dtype=dtype)
        for tp, rank in GENERATOR_LAYOUTS:
            layout = vllm_layout(description, rank, tp)
            receivers[("vllm", tp, rank, dtype)] = WeightReceiver(
                description, layout=layout, dtype=dtype
            )
    return receivers


def _check(receiver_key: tuple, applied, full: dict[str, torch.Tensor]) -> None:
    kind, tp, rank, dtype = receiver_key
    expected = full if kind == "hf" else expected_vllm_tensors(full, CONFIG, rank, tp)
    got = dict(applied)
    assert set(got) == set(expected), receiver_key
    for name, tensor in got.items():
        assert tensor.dtype == dtype
        want = expected[name].to(dtype)
        assert tensor.shape == want.shape, (receiver_key, name)
        assert torch.equal(tensor, want), (receiver_key, name)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_kind", MESH_KINDS)
def test_grid(gloo_trainer, mesh_kind: str) -> None:
    description = ModelDescription.from_hf_config(CONFIG)
    full = full_params()
    receivers = _receivers(description)

    first = gloo_trainer.manifest(mesh_kind, 1)
    assert not first.version_only
    assert {s.publisher_rank for s in first.shards} == set(range(WORLD))
    assert len(first.shards) == len(full) * WORLD  # every rank holds a shard of every param
    if mesh_kind == "fsdp2xtp2":
        placements = {str(s.placements) for s in first.shards if s.name.endswith("q_proj.weight")}
        assert any("split_factor: 2" in p for p in placements)  # FSDP2 over TP: _StridedShard
    for key, receiver in receivers.items():
        applied = receiver.apply(first)
        assert not applied.plan_cached
        _check(key, applied, full)

    gloo_trainer.acknowledge(mesh_kind, 1)
    second = gloo_trainer.manifest(mesh_kind, 2)
    assert second.version_only and not second.shards
    assert second.model_fingerprint == first.model_fingerprint
    updated = {name: t + 1.0 for name, t in full.items()}
    for key, receiver in receivers.items():
        applied = receiver.apply(second)
        assert applied.plan_cached
        _check(key, applied, updated)


def test_plain_module_every_layout() -> None:
    """A trainer of one process (plain tensors), incl. TP 4 where vLLM replicates KV heads."""
    from podrl.weights import ManifestAssembler, WeightPublisher
    from tests.harness.weights import publish_single_process
    from tests.weights.tiny_qwen3 import make_model

    model = make_model()
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    description = ModelDescription.from_hf_config(CONFIG)
    publisher = WeightPublisher(model)
    manifest = publish_single_process(publisher, ManifestAssembler("t"), 1)
    try:
        for dtype in DTYPES:
            for tp in (1, 2, 4):
                for rank in range(tp):
                    receiver = WeightReceiver(
                        description, layout=vllm_layout(description, rank, tp), dtype=dtype
                    )
                    _check(("vllm", tp, rank, dtype), receiver.apply(manifest), full)
    finally:
        publisher.close()
