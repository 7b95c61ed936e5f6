"""TrainState: the trainer's version, last reply, schedule and RNG, and the dict that carries
them into a checkpoint or to a healing pod."""

from __future__ import annotations

import json

import torch

from podrl.trainer.engine import TrainState
from podrl.v1 import trainer_pb2


def _state(lr: float = 1.0) -> TrainState:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    return TrainState(scheduler, torch.device("cpu"))


def test_advance_moves_the_schedule_and_the_version_together() -> None:
    state = _state()
    assert (state.policy_version, state.learning_rate) == (0, 1.0)
    assert state.advance() == 1
    assert (state.policy_version, state.learning_rate) == (1, 0.5)


def test_the_state_dict_round_trips_through_json_and_drops_the_stored_reply() -> None:
    source = _state()
    source.advance()
    source.advance()
    source.applied("b-2", trainer_pb2.TrainResponse(policy_version=2))
    saved = json.loads(json.dumps(source.state_dict()))  # what trainer_state.json holds
    expected_draw = torch.rand(4)  # the RNG continues from the saved state

    target = _state()
    target.applied("b-0", trainer_pb2.TrainResponse(policy_version=0))
    target.load_state_dict(saved)
    assert target.policy_version == 2
    assert target.learning_rate == source.learning_rate == 1.0 / 3
    # The reply belongs to the weights that were replaced: a batch sent again trains again.
    assert target.last_train is None
    assert torch.equal(torch.rand(4), expected_draw)
    assert "last_train" not in saved and "step" not in saved
