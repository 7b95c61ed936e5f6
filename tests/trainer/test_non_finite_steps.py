"""Numbers that are not numbers never reach the weights.

* ``validate_train_request`` refuses advantages beyond ±MAX_ABS_ADVANTAGE (a finite
  3e38 turned every weight into NaN and the reply was OK) and logprobs below its floor;
* a step whose loss or gradient norm is NaN or infinite applies nothing on any rank and answers
  FAILED_PRECONDITION naming the cause;
* weights holding NaN or infinity are never published (FAILED_PRECONDITION naming the
  parameter, agreed by every rank).

The service runs on a copy of the tiny model whose final norm holds infinity: real weights gone
bad, loaded the way a trainer loads any model.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from podrl.trainer.batch import (
    MAX_ABS_ADVANTAGE,
    MIN_GENERATOR_LOGPROB,
    BatchError,
    BatchLimits,
    validate_train_request,
)
from podrl.v1 import common_pb2, trainer_pb2
from tests.trainer.rank_worker import make_request
from tests.trainer.service_process import trainer_service

LIMITS = BatchLimits(vocab_size=1000, max_positions=1024)
POISONED = "model.norm.weight"


@pytest.mark.parametrize("advantage", [3e38, -3e38, MAX_ABS_ADVANTAGE * 1.01])
def test_advantages_beyond_the_bound_are_refused(advantage: float) -> None:
    """Before this check: a finite advantage of 3e38 was trained on."""
    request = make_request(1)
    request.sequences[2].advantage = advantage
    with pytest.raises(BatchError, match=r"sequences\[2\]\.advantage: .* lies outside"):
        validate_train_request(request, 0, LIMITS)


def test_advantages_and_logprobs_within_the_bounds_are_accepted() -> None:
    request = make_request(1)
    request.sequences[0].advantage = MAX_ABS_ADVANTAGE
    request.sequences[1].advantage = -MAX_ABS_ADVANTAGE
    request.sequences[2].generator_logprobs[0] = MIN_GENERATOR_LOGPROB
    validate_train_request(request, 0, LIMITS)
    request.sequences[2].generator_logprobs[0] = -3e38
    with pytest.raises(BatchError, match=r"sequences\[2\]\.generator_logprobs"):
        validate_train_request(request, 0, LIMITS)


@pytest.fixture(scope="module")
def poisoned_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("poisoned") / "model"
    folder.mkdir()
    for item in tiny_model.iterdir():
        if item.is_file():
            (folder / item.name).write_bytes(item.read_bytes())
    weights = load_file(folder / "model.safetensors")
    weights[POISONED] = torch.full_like(weights[POISONED], float("inf"))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.slow
def test_non_finite_steps_and_weights_change_nothing_and_say_why(poisoned_model, tmp_path):
    with trainer_service(poisoned_model, tmp_path, dp_shard=2) as (_, stub):
        digest = stub.ParametersDigest(trainer_pb2.ParametersDigestRequest(), timeout=60).sha256

        request = make_request(3)
        request.sequences[0].advantage = 3e38
        with pytest.raises(grpc.RpcError) as refused:
            stub.Train(request, timeout=120)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sequences[0].advantage" in refused.value.details()

        with pytest.raises(grpc.RpcError) as not_finite:
            stub.Train(make_request(3), timeout=120)
        assert not_finite.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = not_finite.value.details()
        assert "NonFiniteStepError" in details and "no update was applied" in details
        assert "loss is nan" in details or "loss is inf" in details

        info = stub.Info(common_pb2.InfoRequest(), timeout=30)
        assert (info.step, info.policy_version) == (0, 0)
        again = stub.ParametersDigest(trainer_pb2.ParametersDigestRequest(), timeout=60).sha256
        assert again == digest  # no rank stepped

        with pytest.raises(grpc.RpcError) as unpublished:
            stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
        assert unpublished.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert POISONED in unpublished.value.details()
        assert "NaN or infinity" in unpublished.value.details()
