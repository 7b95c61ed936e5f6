"""The trainer's speed options: optimizer implementation, activation checkpointing and the
foreach gradient clipping compute what the plain versions compute."""

from __future__ import annotations

import os

import pytest
import torch

from podrl.config import load_config
from podrl.trainer.batch import collate
from podrl.trainer.engine import TrainerEngine, clip_grad_norm
from tests.trainer.rank_worker import config_env, make_request


def _engine(tiny_model, tmp_path, **trainer: object) -> TrainerEngine:
    env = config_env(str(tiny_model), str(tmp_path), **trainer)
    return TrainerEngine.build(load_config(None, {**os.environ, **env}))


@pytest.mark.parametrize(
    ("impl", "fused", "foreach"),
    [
        ("auto", None, True),
        ("fused", True, None),
        ("foreach", None, True),
        ("for_loop", None, False),
    ],
)
def test_optimizer_impl_picks_the_adamw_implementation(tiny_model, tmp_path, impl, fused, foreach):
    engine = _engine(tiny_model, tmp_path, optimizer_impl=impl)
    try:
        # auto on CPU with tp 1 is foreach (fused is chosen on CUDA only).
        assert engine.optimizer.defaults["fused"] == fused
        assert engine.optimizer.defaults["foreach"] == foreach
    finally:
        engine.close()


def test_fused_adamw_trains_like_the_for_loop(tiny_model, tmp_path):
    losses = {}
    for impl in ("for_loop", "fused", "foreach"):
        engine = _engine(tiny_model, tmp_path, optimizer_impl=impl)
        try:
            losses[impl] = [
                engine.train_step(make_request(seed, version=engine.policy_version)).metrics.loss
                for seed in (1, 2, 3)
            ]
        finally:
            engine.close()
    assert losses["fused"] == pytest.approx(losses["for_loop"], rel=1e-5, abs=1e-6)
    assert losses["foreach"] == pytest.approx(losses["for_loop"], rel=1e-5, abs=1e-6)


def _saved_tensors_of_one_forward(engine: TrainerEngine) -> tuple[int, float]:
    """(tensors autograd keeps for backward during one forward, that forward's loss)."""
    sequences = list(make_request(4).sequences)
    batch = collate(sequences, engine.pad_id, packed=True)
    saved = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += 1
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, _ = engine._token_logprobs(engine.model, batch)
    loss = (logprobs * batch.loss_mask).sum()
    loss.backward()
    return saved, loss.item()


def test_activation_checkpointing_keeps_fewer_tensors_and_computes_the_same(tiny_model, tmp_path):
    plain = _engine(tiny_model, tmp_path)
    try:
        plain_saved, plain_loss = _saved_tensors_of_one_forward(plain)
        plain_grads = [p.grad.clone() for p in plain.model.parameters()]
    finally:
        plain.close()
    ckpt = _engine(tiny_model, tmp_path, activation_checkpointing=True)
    try:
        ckpt_saved, ckpt_loss = _saved_tensors_of_one_forward(ckpt)
        ckpt_grads = [p.grad for p in ckpt.model.parameters()]
    finally:
        ckpt.close()
    assert ckpt_saved < plain_saved / 2  # each layer keeps its input, not its activations
    assert ckpt_loss == plain_loss  # the recomputation is the same arithmetic: bitwise
    for a, b in zip(ckpt_grads, plain_grads, strict=True):
        assert torch.equal(a, b)


def test_foreach_clipping_matches_torch_clip_grad_norm():
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 3), (5,), (2, 2, 2), (0,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(a.shape, generator=gen)
        b.grad = a.grad.clone()
    norm = clip_grad_norm(ours, max_norm=0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm=0.5)
    torch.testing.assert_close(norm, expected)
    assert norm > 0.5  # the gradients were actually scaled down
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_cpu_trainer_leaves_one_core_to_the_pod_unless_omp_num_threads_says_otherwise(
    tiny_model, tmp_path, monkeypatch
):
    import torch

    from podrl.trainer.parallel import cpu_threads

    cores = len(os.sched_getaffinity(0))
    assert cpu_threads({}) == max(1, cores - 1)
    assert cpu_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert cpu_threads({"OMP_NUM_THREADS": "0"}) == max(1, cores - 1)  # not a thread count
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    engine = _engine(tiny_model, tmp_path)
    try:
        assert torch.get_num_threads() == max(1, cores - 1)
    finally:
        engine.close()
        torch.set_num_threads(before)
