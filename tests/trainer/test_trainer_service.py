"""The trainer service over real gRPC, started as `python -m podrl.trainer` with 2 FSDP ranks
(its own launcher): bad batches get INVALID_ARGUMENT and leave the model untouched, good batches
train, checkpoints restore the weights and are pruned to the latest ones, exports work through
the RPCs, SIGTERM stops every rank cleanly."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import psutil
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from transformers import AutoModelForCausalLM

from podrl.algorithms.losses import BatchTotals, LossSettings, policy_loss
from podrl.trainer import checkpoint
from podrl.v1 import common_pb2, trainer_pb2
from tests.trainer.rank_worker import make_request
from tests.trainer.service_process import trainer_service

pytestmark = pytest.mark.slow


def _reference_first_loss(model_dir, request: trainer_pb2.TrainRequest) -> float:
    """GRPO loss of the untouched initial model, computed with plain transformers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    totals = BatchTotals(
        len(request.sequences), sum(len(s.completion_ids) for s in request.sequences)
    )
    total = 0.0
    with torch.no_grad():
        for seq in request.sequences:
            ids = torch.tensor([[*seq.prompt_ids, *seq.completion_ids]])
            logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            logp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
            start = len(seq.prompt_ids) - 1
            logp = logp[start : start + len(seq.completion_ids)]
            terms = policy_loss(
                logp[None],
                torch.tensor([list(seq.generator_logprobs)]),
                torch.tensor([seq.advantage]),
                torch.ones_like(logp)[None],
                LossSettings(),
                totals,
            )
            total += terms.loss.item()
    return total


@pytest.fixture(scope="module")
def service(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("service")
    extra = {"PODRL_TRAINER__CHECKPOINT_KEEP_LATEST": "2"}
    with trainer_service(tiny_model, tmp, timeout=120, extra_env=extra) as (process, stub):
        yield process, stub, tmp


def _exported_weights(stub, path: Path) -> bytes:
    """The current weights, gathered from every rank (ExportHF)."""
    stub.ExportHF(trainer_pb2.ExportHFRequest(path=str(path)), timeout=120)
    return (path / "model.safetensors").read_bytes()


def _bad_batches() -> dict[str, trainer_pb2.TrainRequest]:
    good = make_request(1)
    cases = {}
    req = trainer_pb2.TrainRequest()
    req.CopyFrom(good)
    req.policy_version = 5
    cases["policy_version"] = req
    cases["sequences: the batch is empty"] = trainer_pb2.TrainRequest(policy_version=0)
    req = trainer_pb2.TrainRequest()
    req.CopyFrom(good)
    req.sequences[1].generator_logprobs.append(-1.0)
    cases["sequences[1].generator_logprobs"] = req
    req = trainer_pb2.TrainRequest()
    req.CopyFrom(good)
    del req.sequences[2].completion_ids[:]
    del req.sequences[2].generator_logprobs[:]
    cases["sequences[2].completion_ids: empty completion"] = req
    req = trainer_pb2.TrainRequest()
    req.CopyFrom(good)
    req.sequences[0].generator_logprobs[0] = float("nan")
    cases["sequences[0].generator_logprobs"] = req
    req = trainer_pb2.TrainRequest()
    req.CopyFrom(good)
    req.sequences[3].advantage = float("inf")
    cases["sequences[3].advantage"] = req
    req = trainer_pb2.TrainRequest()
    req.CopyFrom(good)
    req.sequences[0].completion_ids[0] = 10_000
    cases["token ids must lie in"] = req
    return cases


def test_bad_batches_are_rejected_and_the_next_good_one_trains(service, tiny_model):
    _, stub, _ = service
    info = stub.Info(common_pb2.InfoRequest(), timeout=10)
    assert info.world_size == 2 and list(info.mesh.shape) == [2, 1]
    for needle, request in _bad_batches().items():
        with pytest.raises(grpc.RpcError) as err:
            stub.Train(request, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
        assert needle in err.value.details(), err.value.details()
    info = stub.Info(common_pb2.InfoRequest(), timeout=10)
    assert (info.step, info.policy_version) == (0, 0)
    good = make_request(1)
    reply = stub.Train(good, timeout=120)
    assert (reply.step, reply.policy_version) == (1, 1)
    # The model was untouched by the rejected batches: the loss is the initial model's.
    assert reply.metrics.loss == pytest.approx(_reference_first_loss(tiny_model, good), abs=1e-5)
    assert reply.metrics.tokens == sum(len(s.completion_ids) for s in good.sequences)
    assert reply.metrics.grad_norm > 0 and reply.metrics.learning_rate == pytest.approx(1e-3)
    second = stub.Train(make_request(2, version=1), timeout=120)
    assert second.policy_version == 2


def test_checkpoint_and_export_rpcs(service):
    _, stub, tmp = service
    with pytest.raises(grpc.RpcError) as err:
        stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=str(tmp / "nope")), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    saved = stub.SaveCheckpoint(
        trainer_pb2.SaveCheckpointRequest(controller_state=b"\x00position=7"), timeout=120
    )
    assert saved.path == str(tmp / "checkpoints" / f"step-{saved.step:08d}")
    saved_weights = _exported_weights(stub, tmp / "at-save")
    before = stub.Info(common_pb2.InfoRequest(), timeout=10)
    stub.Train(make_request(3, version=before.policy_version), timeout=120)
    assert _exported_weights(stub, tmp / "trained") != saved_weights
    loaded = stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=saved.path), timeout=120)
    assert loaded.controller_state == b"\x00position=7"
    assert (loaded.step, loaded.policy_version) == (saved.step, saved.policy_version)
    # The weights came back on every rank, not only the counters.
    assert _exported_weights(stub, tmp / "loaded") == saved_weights
    # The last Train's stored reply belongs to weights that are gone.
    assert not stub.Info(common_pb2.InfoRequest(), timeout=10).HasField("last_train")
    exported = stub.ExportHF(trainer_pb2.ExportHFRequest(), timeout=120)
    assert "model.safetensors" in exported.files and "config.json" in exported.files


def test_saves_keep_the_latest_two_and_a_resave_replaces_its_folder(service):
    _, stub, tmp = service
    paths = []
    for seed in (4, 5, 6):
        version = stub.Info(common_pb2.InfoRequest(), timeout=10).policy_version
        stub.Train(make_request(seed, version=version), timeout=120)
        paths.append(stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120).path)
    again = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
    assert again.path == paths[-1]  # same step, same folder, replaced whole
    folders = sorted((tmp / "checkpoints").iterdir())
    assert [str(f) for f in folders] == paths[-2:]  # trainer.checkpoint_keep_latest = 2
    assert all(checkpoint.is_checkpoint(f) for f in folders)


def test_sigterm_stops_every_rank(service):
    process, _, tmp = service
    ranks = psutil.Process(process.pid).children()
    assert len(ranks) == 2
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0, (tmp / "trainer.log").read_text()[-3000:]
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive
    # The launcher exits 0 only if every rank did; rank 1 left on rank 0's command.
    log = (tmp / "trainer.log").read_text()
    assert "rank 1: shutdown from rank 0" in log
    assert "trainer stopped" in log
