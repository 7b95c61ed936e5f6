"""A Train is refused up front (FAILED_PRECONDITION) while weights published from the live GPU
parameters await their acknowledgement: the acknowledgement travels through the same rank
command loop a running step would occupy, so waiting inside the step could only time out."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch

from podrl.trainer.engine import TrainNotAllowedError
from podrl.trainer.servicer import TrainerServicer
from podrl.v1 import trainer_pb2
from podrl.weights.trainer_weight_sync import TrainerWeightSync


def _engine() -> SimpleNamespace:
    model = torch.nn.Linear(4, 4)
    return SimpleNamespace(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        policy_version=3,
        train_gates=[],
    )


def test_the_gate_refuses_while_a_direct_publication_is_pending() -> None:
    engine = _engine()
    sync = TrainerWeightSync(engine, rank=0, publisher_id="pod-0")
    assert engine.train_gates == [sync._check_can_train]
    sync._check_can_train()  # nothing published: a step may run
    # What a GPU publisher reports between publish and acknowledgement (CPU staging never does).
    sync.publisher = SimpleNamespace(must_wait_before_step=True, pending_version=3)
    with pytest.raises(TrainNotAllowedError, match=r"version 3 .* not acknowledged"):
        sync._check_can_train()
    sync.publisher = SimpleNamespace(must_wait_before_step=False, pending_version=None)
    sync._check_can_train()


class _AbortedError(Exception):
    pass


class _Context:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise _AbortedError


def test_the_servicer_answers_failed_precondition_and_runs_nothing() -> None:
    def refuse(_request: trainer_pb2.TrainRequest) -> None:
        raise TrainNotAllowedError("version 3 is not acknowledged")

    ran: list[str] = []
    loop = SimpleNamespace(run=lambda name, payload: ran.append(name))
    servicer = TrainerServicer(SimpleNamespace(), SimpleNamespace(validate=refuse), loop)
    context = _Context()
    with pytest.raises(_AbortedError):
        servicer.Train(trainer_pb2.TrainRequest(policy_version=3), context)
    assert context.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "not acknowledged" in context.details
    assert ran == [], "no rank may start a step that the gate refused"
