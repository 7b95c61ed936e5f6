"""PublishWeights/AcknowledgeWeights of the real trainer service (2 FSDP2 ranks on gloo, its own
launcher) applied by a receiver in this process; segments vanish when the trainer stops."""

from __future__ import annotations

from pathlib import Path

import grpc
import psutil
import pytest
import torch
from safetensors.torch import load_file

from podrl.models.tiny import make_tiny_model
from podrl.v1 import common_pb2, trainer_pb2
from podrl.weights import ModelDescription, WeightReceiver, vllm_layout
from podrl.weights.protocol import list_segments
from tests.trainer.rank_worker import make_request
from tests.trainer.service_process import trainer_service
from tests.weights.reference_layout import expected_vllm_tensors

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("trainer")
    model_dir = make_tiny_model(tmp / "model")
    with trainer_service(model_dir, tmp) as (process, stub):
        yield process, stub, model_dir, tmp


def test_publish_apply_acknowledge_train_publish(trainer) -> None:
    process, stub, model_dir, tmp = trainer
    description = ModelDescription.from_pretrained(model_dir)
    info = stub.Info(common_pb2.InfoRequest(), timeout=30)
    hf = WeightReceiver(description, trusted_publisher_id=info.info.worker_id)
    tp_rank1 = WeightReceiver(description, layout=vllm_layout(description, 1, 2))

    first = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60).manifest
    assert not first.version_only and first.version == 0
    assert {s.publisher_rank for s in first.shards} == {0, 1}  # every rank its own shards
    initial = load_file(str(model_dir / "model.safetensors"))
    applied = dict(hf.apply(first))
    assert all(torch.equal(applied[n], initial[n]) for n in description.params)
    want = expected_vllm_tensors(
        initial, {"num_key_value_heads": 2, "head_dim": description.head_dim}, 1, 2
    )
    assert all(torch.equal(t, want[n]) for n, t in tp_rank1.apply(first))

    # On CPU the step may run before the acknowledgement: it leaves the staging copy alone.
    assert stub.Train(make_request(1), timeout=120).policy_version == 1
    fresh = WeightReceiver(description, trusted_publisher_id=info.info.worker_id)
    assert all(torch.equal(t, initial[n]) for n, t in fresh.apply(first))
    # The next publish would overwrite the staging copy: refused until the acknowledgement.
    with pytest.raises(grpc.RpcError) as error:
        stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "version 0 is not acknowledged" in error.value.details()
    fresh.close()
    stub.AcknowledgeWeights(trainer_pb2.AcknowledgeWeightsRequest(version=0), timeout=30)

    second = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60).manifest
    assert second.version_only and second.version == 1
    assert second.model_fingerprint == first.model_fingerprint
    result = hf.apply(second)
    assert result.plan_cached
    export = stub.ExportHF(trainer_pb2.ExportHFRequest(path=str(tmp / "export")), timeout=120)
    trained = load_file(str(Path(export.path) / "model.safetensors"))
    updated = dict(result)
    assert any(not torch.equal(updated[n], initial[n]) for n in description.params)
    assert all(torch.equal(updated[n], trained[n]) for n in description.params)
    stub.AcknowledgeWeights(trainer_pb2.AcknowledgeWeightsRequest(version=1), timeout=30)

    # A new generator asks for a full manifest of the same storage.
    again = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(force_full=True), timeout=60)
    assert not again.manifest.version_only and again.manifest.version == 1

    ranks = [process.pid, *(c.pid for c in psutil.Process(process.pid).children(recursive=True))]
    assert any(list_segments(pid) for pid in ranks)
    process.terminate()
    process.wait(timeout=60)
    assert all(list_segments(pid) == [] for pid in ranks)
