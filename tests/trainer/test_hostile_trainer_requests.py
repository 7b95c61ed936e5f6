"""Hostile requests with the controller's credentials against the real trainer service
(`python -m podrl.trainer`, 2 FSDP2 gloo ranks): acknowledgements of versions that
are not pending refused."""

from __future__ import annotations

import grpc
import pytest

from podrl.v1 import common_pb2, trainer_pb2
from tests.trainer.rank_worker import make_request
from tests.trainer.service_process import trainer_service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    run_dir = tmp / "run"
    run_dir.mkdir()
    with trainer_service(tiny_model, run_dir, timeout=120) as (process, stub):
        yield process, stub, run_dir, tmp


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def test_acknowledgements_of_versions_not_pending_are_refused(service) -> None:
    """AcknowledgeWeights of a version never published (2^64-1, 999) or not the pending one is
    FAILED_PRECONDITION naming the pending version, and releases nothing; the pending
    version's, a repeat of the last acknowledged one and, with nothing pending, the trainer's
    own version are answered."""
    _, stub, _, _ = service

    def ack(version: int, generator_id: str = "controller") -> None:
        stub.AcknowledgeWeights(
            trainer_pb2.AcknowledgeWeightsRequest(version=version, generator_id=generator_id),
            timeout=30,
        )

    version = stub.Info(common_pb2.InfoRequest(), timeout=10).policy_version
    ack(version)  # nothing pending: the controller's align acknowledges the trainer's version
    for bogus in (2**64 - 1, 999):
        code, details = _code(lambda b=bogus: ack(b))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert details.startswith(f"AcknowledgeWeightsRequest.version: {bogus} is not the pending")
        assert "pending: none" in details
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    for bogus in (2**64 - 1, 999, version + 1):
        code, details = _code(lambda b=bogus: ack(b))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert f"pending: {version}" in details
    # Nothing was released: the next version may not be published over the pending one.
    stub.Train(make_request(11, version=version), timeout=120)
    code, details = _code(
        lambda: stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"version {version} is not acknowledged" in details
    ack(version, generator_id="")  # the pending one (generator_id is not read)
    ack(version, generator_id="g" * 1_000_000)  # a retry of it
    published = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    assert published.manifest.version == version + 1
    ack(version)  # a late retry of the older one releases nothing
    code, _ = _code(lambda: ack(version + 7))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    ack(version + 1)
