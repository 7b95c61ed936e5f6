"""A replicated trainer (``trainer.replication``: a Lighthouse, torchft) trains as an
unreplicated one when it is alone: in a quorum of one pod it runs no cross-pod collective (the
sum over one pod is the pod's own value, ``CrossPodReplica._alone``), and a step that names it
as its one pod (``pods`` 1) forms no quorum at all (``TrainerEngine._join_pods``)."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
from torchft.process_group import ProcessGroupGloo

from podrl.common.processes import free_ports
from podrl.config import load_config
from podrl.trainer import engine as engine_module
from podrl.trainer.batch import BatchError
from podrl.trainer.engine import TrainerEngine
from podrl.trainer.lighthouse import start_lighthouse
from podrl.v1 import trainer_pb2
from tests.trainer.rank_worker import config_env, make_request

Request = Callable[[int, TrainerEngine], trainer_pb2.TrainRequest]


def _whole_batch(seed: int, engine: TrainerEngine) -> trainer_pb2.TrainRequest:
    return make_request(seed, version=engine.policy_version)


def _alone_in_the_step(seed: int, engine: TrainerEngine) -> trainer_pb2.TrainRequest:
    """The request the controller sends a pod that trains the step alone."""
    request = make_request(seed, version=engine.policy_version)
    request.pods = 1
    request.pod_ids.append(engine.worker_id)
    return request


def _train(
    env: dict[str, str], steps: int, request: Request = _whole_batch
) -> tuple[list[float], str]:
    engine = TrainerEngine.build(load_config(None, {**os.environ, **env}))
    try:
        losses = [
            engine.train_step(request(seed, engine)).metrics.loss for seed in range(1, steps + 1)
        ]
        assert engine.policy_version == steps
        return losses, engine.parameters_digest()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def unreplicated(tiny_model, tmp_path_factory) -> tuple[list[float], str]:
    """Three steps of a trainer without a Lighthouse: the reference."""
    return _train(config_env(str(tiny_model), str(tmp_path_factory.mktemp("alone"))), 3)


def test_a_pod_alone_in_its_quorum_trains_as_one_without_a_lighthouse(
    tiny_model, tmp_path, monkeypatch, unreplicated
):
    alone, alone_digest = unreplicated
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
        # pods 0 (not said): the quorum forms, of this pod alone.
        replicated, replicated_digest = _train(env, 3)
    finally:
        lighthouse.shutdown()
    assert cross_pod_calls == []  # no counts, vote, logprob gap or gradient exchange
    assert replicated == pytest.approx(alone, rel=1e-6, abs=1e-7)
    assert replicated_digest == alone_digest


def test_a_step_of_one_pod_forms_no_quorum_and_still_checks_its_batch(
    tiny_model, tmp_path, monkeypatch, unreplicated
):
    alone, alone_digest = unreplicated

    def no_replica(*args, **kwargs):
        raise AssertionError("a step this pod trains alone built its torchft replica")

    monkeypatch.setattr(engine_module, "CrossPodReplica", no_replica)
    # Nothing listens at the Lighthouse's address: a quorum could not even be asked for.
    env = {
        **config_env(str(tiny_model), str(tmp_path / "replica")),
        "PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS": f"127.0.0.1:{free_ports(1)[0]}",
    }
    replicated, replicated_digest = _train(env, 3, _alone_in_the_step)
    assert replicated == pytest.approx(alone, rel=1e-6, abs=1e-7)
    assert replicated_digest == alone_digest

    # The batch is checked as a quorum's step checks it (after the join): a wrong version.
    engine = TrainerEngine.build(load_config(None, {**os.environ, **env}))
    try:
        stale = _alone_in_the_step(1, engine)
        stale.policy_version = 5
        with pytest.raises(BatchError, match="policy_version"):
            engine.train_step(stale)
        assert engine.policy_version == 0
    finally:
        engine.close()
