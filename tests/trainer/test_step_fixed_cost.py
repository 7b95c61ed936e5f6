"""The trainer's fixed cost per step: a one-rank trainer trains the plain module (no FSDP2
hooks, no DTensor dispatch) and computes what FSDP2 over one rank computes; a step reads device
values on the host in two transfers, not one per figure."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from podrl.config import load_config
from podrl.trainer.engine import _PEAKS, _SUMS, TrainerEngine
from tests.trainer.rank_worker import config_env, make_request


def _engine(tiny_model, tmp_path, **trainer: object) -> TrainerEngine:
    env = config_env(str(tiny_model), str(tmp_path), **trainer)
    return TrainerEngine.build(load_config(None, {**os.environ, **env}))


def _steps(engine: TrainerEngine) -> tuple[list[tuple[float, ...]], list[torch.Tensor]]:
    metrics = []
    for seed in (1, 2, 3):
        m = engine.train_step(make_request(seed, version=engine.policy_version)).metrics
        metrics.append((m.loss, m.grad_norm, m.entropy, m.update_ratio, m.ratio_max))
    params = [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in engine.model.parameters()
    ]
    return metrics, params


def test_a_one_rank_trainer_trains_the_plain_module_as_fsdp_over_one_rank_does(
    tiny_model, tmp_path
):
    plain = _engine(tiny_model, tmp_path)
    try:
        assert not plain.fsdp
        assert not any(isinstance(m, FSDPModule) for m in plain.model.modules())
        assert not any(isinstance(p, DTensor) for p in plain.model.parameters())
        plain_metrics, plain_params = _steps(plain)
    finally:
        plain.close()
    wrapped = _engine(tiny_model, tmp_path, fsdp="always")
    try:
        assert wrapped.fsdp
        assert all(isinstance(p, DTensor) for p in wrapped.model.parameters())
        fsdp_metrics, fsdp_params = _steps(wrapped)
    finally:
        wrapped.close()
    # fp32 on CPU: the same arithmetic up to the order of a few sums.
    for got, expected in zip(plain_metrics, fsdp_metrics, strict=True):
        assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)
    for got, expected in zip(plain_params, fsdp_params, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_a_step_reads_device_values_on_the_host_twice(tiny_model, tmp_path, monkeypatch):
    """Once before the optimizer step (gradient norm, metric sums and maxima together: on CUDA
    one synchronisation) and once after it (the update size). Counted: podrl's own reads of
    floating-point tensors (the agreement's vote is an int32 host tensor; torch's optimizer
    reads its host-side step counters)."""
    engine = _engine(tiny_model, tmp_path)
    request = make_request(1, version=engine.policy_version)
    reads: list[int] = []
    for name in ("tolist", "item", "__float__"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: object, _original=original) -> object:
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if self.is_floating_point() and caller.startswith("podrl."):
                reads.append(self.numel())
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        engine.train_step(request)
    finally:
        monkeypatch.undo()
        engine.close()
    assert reads == [1 + len(_SUMS) + len(_PEAKS), 2]
