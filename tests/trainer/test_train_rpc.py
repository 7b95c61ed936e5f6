"""Train over real gRPC (`python -m podrl.trainer`: 2 FSDP2 ranks, its own launcher, faults
injected on rank 1 through PODRL_FAULTS).

* a rank failing before the optimizer step: ABORTED, nothing changed, the batch may come again;
* a rank failing after it: OK with the step's metrics (the step is applied on every rank);
* Train is idempotent by ``batch_id``: the same batch again (a retry after a lost reply, also
  one sent while the first call still runs) gets the first reply and trains nothing, and
  ``TrainerInfo.last_batch_id``/``last_train`` report it.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from podrl.v1 import common_pb2, trainer_pb2
from tests.trainer.rank_worker import make_request
from tests.trainer.service_process import trainer_service

pytestmark = pytest.mark.slow

FAULTS = [
    {"point": "trainer.before_optimizer_step", "action": "raise", "rank": 1, "times": 1},
    {"point": "trainer.after_optimizer_step", "action": "raise", "rank": 1, "times": 1},
]


@pytest.fixture(scope="module")
def service(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-rpc")
    extra = {"PODRL_FAULTS": json.dumps(FAULTS)}
    with trainer_service(tiny_model, tmp, timeout=120, extra_env=extra) as (_, stub):
        yield stub, tmp


def _request(seed: int, version: int, batch_id: str) -> trainer_pb2.TrainRequest:
    request = make_request(seed, version=version)
    request.batch_id = batch_id
    return request


def _export(stub, path: Path) -> bytes:
    stub.ExportHF(trainer_pb2.ExportHFRequest(path=str(path)), timeout=120)
    return (path / "model.safetensors").read_bytes()


def _info(stub) -> trainer_pb2.TrainerInfo:
    return stub.Info(common_pb2.InfoRequest(), timeout=10)


def test_rank_faults_and_a_lost_reply(service):
    stub, tmp = service
    initial = _export(stub, tmp / "e0")
    batch = _request(1, 0, "step-1/attempt-1")

    with pytest.raises(grpc.RpcError) as err:
        stub.Train(batch, timeout=120)
    assert err.value.code() == grpc.StatusCode.ABORTED, err.value.details()
    assert "rank(s) [1] failed" in err.value.details()
    info = _info(stub)
    assert (info.step, info.policy_version, info.last_batch_id) == (0, 0, "")
    assert _export(stub, tmp / "e1") == initial  # nothing stepped, on any rank

    # Not applied, so the same batch trains now; rank 1 fails after its optimizer step.
    reply = stub.Train(batch, timeout=120)
    assert (reply.step, reply.policy_version) == (1, 1)
    assert reply.metrics.tokens == sum(len(s.completion_ids) for s in batch.sequences)
    assert reply.metrics.grad_norm > 0 and reply.metrics.loss != 0
    log = (tmp / "trainer.log").read_text()
    assert "error after the optimizer step of version 1 (the step is applied)" in log
    trained = _export(stub, tmp / "e2")
    assert trained != initial

    # The reply was lost: the controller sends the same batch again.
    again = stub.Train(batch, timeout=120)
    assert again == reply
    info = _info(stub)
    assert (info.step, info.policy_version) == (1, 1)
    assert info.last_batch_id == "step-1/attempt-1" and info.last_train == reply
    assert _export(stub, tmp / "e3") == trained  # one update only


def test_a_retry_sent_while_the_first_call_runs_gets_its_reply(service):
    stub, _ = service
    version = _info(stub).policy_version
    batch = _request(2, version, "step-2/attempt-1")
    calls = [stub.Train.future(batch, timeout=120) for _ in range(2)]
    first, second = (call.result() for call in calls)
    assert first == second and first.policy_version == version + 1
    assert _info(stub).policy_version == version + 1


def test_without_a_batch_id_every_train_is_a_new_step(service):
    stub, _ = service
    version = _info(stub).policy_version
    reply = stub.Train(make_request(3, version=version), timeout=120)
    assert reply.policy_version == version + 1
    info = _info(stub)
    assert info.last_batch_id == "" and info.last_train == reply
    # Same content, no batch id: trained again (the version check is the only guard).
    with pytest.raises(grpc.RpcError) as err:
        stub.Train(make_request(3, version=version), timeout=120)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Train(make_request(3, version=version + 1), timeout=120).policy_version == (
        version + 2
    )
