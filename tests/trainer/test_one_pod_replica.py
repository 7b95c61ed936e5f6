"""A replicated trainer (``trainer.replication``: a Lighthouse, torchft) alone in its quorum
runs no cross-pod collective and trains exactly as an unreplicated one: the sum over one pod
is the pod's own value (``CrossPodReplica._alone``)."""

from __future__ import annotations

import os

import pytest
from torchft.process_group import ProcessGroupGloo

from podrl.config import load_config
from podrl.trainer.engine import TrainerEngine
from podrl.trainer.lighthouse import start_lighthouse
from tests.trainer.rank_worker import config_env, make_request


def _train(env: dict[str, str], steps: int) -> tuple[list[float], str]:
    engine = TrainerEngine.build(load_config(None, {**os.environ, **env}))
    try:
        losses = [
            engine.train_step(make_request(seed, version=engine.policy_version)).metrics.loss
            for seed in range(1, steps + 1)
        ]
        assert engine.policy_version == steps
        return losses, engine.parameters_digest()
    finally:
        engine.close()


def test_a_pod_alone_in_its_quorum_trains_as_one_without_a_lighthouse(
    tiny_model, tmp_path, monkeypatch
):
    alone, alone_digest = _train(config_env(str(tiny_model), str(tmp_path / "alone")), 3)

    # The torchft Lighthouse itself, without podrl-lighthouse's front: this is about training.
    lighthouse, address = start_lighthouse(load_config(None, os.environ).trainer.replication)
    env = {
        **config_env(str(tiny_model), str(tmp_path / "replica")),
        "PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS": address,
    }
    cross_pod_calls: list[str] = []
    real_allreduce = ProcessGroupGloo.allreduce

    def counted(self, *args, **kwargs):
        cross_pod_calls.append("allreduce")
        return real_allreduce(self, *args, **kwargs)

    monkeypatch.setattr(ProcessGroupGloo, "allreduce", counted)
    try:
        replicated, replicated_digest = _train(env, 3)
    finally:
        lighthouse.shutdown()
    assert cross_pod_calls == []  # no counts, vote, logprob gap or gradient exchange
    assert replicated == pytest.approx(alone, rel=1e-6, abs=1e-7)
    assert replicated_digest == alone_digest
