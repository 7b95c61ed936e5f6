"""The Train gate through the real TrainerServicer: a real engine (1 rank), the real rank
command loop and the real weight-publishing commands (``WeightPublishing`` over a real
``WeightPublisher``), served over real gRPC in this process.

On CPU the real publisher stages weights into shared memory, so it never needs the
acknowledgement before the next step (``must_wait_before_step`` stays False; only the next
publish waits, FAILED_PRECONDITION). The GPU publisher exports the live parameters, and the
refusal it causes is tested with a real CUDA publisher where a GPU is present. What CPU can
show, and does here:

* the gate and the servicer: a gate that refuses makes Train FAILED_PRECONDITION and no rank
  steps;
* the ordering: a PublishWeights sent while a Train is between its gate check and its
  step waits for the step (it takes the same lock), so it publishes the new version.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from podrl.config import RunConfig, load_config
from podrl.config.trainer import ReplicationConfig, TrainerConfig
from podrl.trainer.batch import BatchError
from podrl.trainer.engine import TrainerEngine
from podrl.trainer.errors import NonFiniteStepError, TrainNotAllowedError, error_kind
from podrl.trainer.servicer import (
    CommandLoop,
    RankCommandError,
    TrainerServicer,
    WeightPublishing,
    register_builtin_commands,
    register_commands,
    register_weight_commands,
)
from podrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from podrl.weights.errors import PublishError
from tests.trainer.rank_worker import config_env, make_request

# How long the gate gives a concurrent PublishWeights to (wrongly) finish before the step.
PUBLISH_GRACE_SECONDS = 2.0


@dataclass
class Served:
    engine: TrainerEngine
    sync: WeightPublishing
    stub: trainer_pb2_grpc.TrainerStub
    loop: CommandLoop


def _config(tiny_model, tmp_path, device: str) -> RunConfig:
    env = config_env(str(tiny_model), str(tmp_path))
    env["PODRL_DEVICE"] = device
    return load_config(None, env)


@pytest.fixture
def served(request, tiny_model, tmp_path, monkeypatch) -> Iterator[Served]:
    device = getattr(request, "param", "cpu")
    monkeypatch.delenv("MASTER_ADDR", raising=False)  # one rank, in-process store
    config = _config(tiny_model, tmp_path, device)
    engine = TrainerEngine.build(config)
    loop = CommandLoop.build(config.trainer)
    register_builtin_commands(loop, engine)
    sync = register_weight_commands(
        loop,
        engine,
        rank=0,
        publisher_id=config.worker_id,
        ack_timeout=config.trainer.weights_ack_timeout_seconds,
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trainer_pb2_grpc.add_TrainerServicer_to_server(
        TrainerServicer.build(config, engine, loop), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Served(engine, sync, trainer_pb2_grpc.TrainerStub(channel), loop)
    finally:
        channel.close()
        server.stop(grace=None)
        loop.shutdown()
        sync.publisher.close()
        engine.close()


def _parameters(engine: TrainerEngine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_a_refusing_gate_is_failed_precondition_and_nothing_steps(served: Served) -> None:
    before = _parameters(served.engine)

    def refuse() -> None:
        raise TrainNotAllowedError("version 0 is not acknowledged (test gate)")

    served.engine.train_gates.append(refuse)
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Train(make_request(1), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not acknowledged (test gate)" in err.value.details()
    info = served.stub.Info(common_pb2.InfoRequest(), timeout=10)
    assert (info.step, info.policy_version) == (0, 0)
    after = _parameters(served.engine)
    assert all(torch.equal(before[n], after[n]) for n in before)
    served.engine.train_gates.remove(refuse)
    assert served.stub.Train(make_request(1), timeout=60).policy_version == 1


def test_the_cpu_publisher_never_blocks_the_next_step(served: Served) -> None:
    served.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    assert served.sync.publisher.pending_version == 0
    assert not served.sync.publisher.must_wait_before_step  # the staging copy is published
    assert served.stub.Train(make_request(1), timeout=60).policy_version == 1
    with pytest.raises(grpc.RpcError) as err:  # the next publish is what waits for the ack
        served.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_publish_during_a_train_waits_for_its_step(served: Served) -> None:
    published: list[trainer_pb2.PublishWeightsResponse] = []
    done = threading.Event()
    finished_during_gate: list[bool] = []

    def publish() -> None:
        published.append(
            served.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=120)
        )
        done.set()

    publisher = threading.Thread(target=publish)

    def gate_that_lets_a_publish_in() -> None:
        # Runs after the real gate passed, before the step: a publish landing now would
        # (on a GPU) leave the step waiting for an ack that cannot come.
        publisher.start()
        finished_during_gate.append(done.wait(PUBLISH_GRACE_SECONDS))

    served.engine.train_gates.append(gate_that_lets_a_publish_in)
    reply = served.stub.Train(make_request(1), timeout=120)
    publisher.join(timeout=120)
    assert finished_during_gate == [False], "PublishWeights ran between the gate and the step"
    assert reply.policy_version == 1
    assert published[0].manifest.version == 1  # published after the step, not before it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the direct publisher needs CUDA")
@pytest.mark.parametrize("served", ["cuda"], indirect=True)
def test_a_gpu_publication_refuses_train_until_acknowledged(served: Served) -> None:
    served.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    assert served.sync.publisher.must_wait_before_step  # live parameters are published
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Train(make_request(1), timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "version 0 was published from the live GPU parameters" in err.value.details()
    assert served.stub.Info(common_pb2.InfoRequest(), timeout=10).policy_version == 0
    served.stub.AcknowledgeWeights(trainer_pb2.AcknowledgeWeightsRequest(version=0), timeout=30)
    assert served.stub.Train(make_request(1), timeout=60).policy_version == 1


def test_one_rank_runs_its_commands_without_collectives(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One rank has no one to tell: a command, the publish's finiteness verdict and the gather
    # of its shards are local (on CUDA each collective would also synchronise the device).
    calls: list[str] = []
    for name in ("broadcast", "all_gather", "gather", "all_reduce"):
        monkeypatch.setattr(torch.distributed, name, lambda *a, _n=name, **k: calls.append(_n))
    reply = served.stub.PublishWeights(trainer_pb2.PublishWeightsRequest())
    assert reply.manifest.shards  # this rank's shards, published
    served.stub.AcknowledgeWeights(
        trainer_pb2.AcknowledgeWeightsRequest(
            version=reply.manifest.version, generator_id="controller"
        )
    )
    assert calls == []


class _RefusedShareError(BatchError):
    """A subclass: its class name is not BatchError's, its kind is."""


def test_a_batch_error_subclass_raised_in_the_step_is_invalid_argument(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Replicated trainers check the batch inside the step, on every rank: the kind the rank
    # sets where it caught the error decides the code, not the error's class name.
    def refuse(request: trainer_pb2.TrainRequest, *_: object) -> trainer_pb2.TrainResponse:
        raise _RefusedShareError("sequences[0].advantage: refused by the test")

    monkeypatch.setattr(served.engine, "train_step", refuse)
    with pytest.raises(grpc.RpcError) as err:
        served.stub.Train(make_request(1), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "TrainRequest.sequences[0].advantage: refused by the test"


def test_a_step_aborted_on_some_ranks_and_non_finite_on_others_is_aborted() -> None:
    def failed(kind: int) -> trainer_pb2.RankReply:
        return trainer_pb2.RankReply(error="x", error_kind=kind)

    aborted = RankCommandError(
        "train",
        {
            0: failed(trainer_pb2.RANK_ERROR_KIND_NON_FINITE_STEP),
            1: failed(trainer_pb2.RANK_ERROR_KIND_STEP_ABORTED),
        },
    )
    assert aborted.kind == trainer_pb2.RANK_ERROR_KIND_STEP_ABORTED
    mixed = RankCommandError(
        "train",
        {
            0: failed(trainer_pb2.RANK_ERROR_KIND_INVALID_REQUEST),
            1: failed(trainer_pb2.RANK_ERROR_KIND_STEP_ABORTED),
        },
    )
    assert mixed.kind == trainer_pb2.RANK_ERROR_KIND_INTERNAL
    assert error_kind(_RefusedShareError("x")) == trainer_pb2.RANK_ERROR_KIND_INVALID_REQUEST
    assert error_kind(NonFiniteStepError("x")) == trainer_pb2.RANK_ERROR_KIND_NON_FINITE_STEP
    assert error_kind(PublishError("x")) == trainer_pb2.RANK_ERROR_KIND_NOT_NOW
    assert error_kind(ValueError("x")) == trainer_pb2.RANK_ERROR_KIND_INTERNAL


def test_the_optimizer_waits_for_an_acknowledgement_as_long_as_the_config_says(
    tiny_model, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The live GPU case on CPU: a publisher whose version is pending and whose acknowledgement
    # never comes; the step's pre-hook waits trainer.weights_ack_timeout_seconds, then fails.
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    env = config_env(str(tiny_model), str(tmp_path), weights_ack_timeout_seconds=2.5)
    engine = TrainerEngine.build(load_config(None, env))
    sync = register_commands(CommandLoop.build(engine.settings), engine)
    waits: list[float | None] = []

    class Unacknowledged:
        pending_version = 7
        must_wait_before_step = True

        def wait_for_acknowledgement(self, timeout: float | None = None) -> bool:
            waits.append(timeout)
            return False

    monkeypatch.setattr(sync, "publisher", Unacknowledged())
    with pytest.raises(TimeoutError, match=r"version 7 .* not acknowledged within 2 s"):
        engine.optimizer.step()
    assert waits == [2.5]


def test_a_train_reads_its_replication_from_the_engine_not_the_config(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine decided at build whether it runs across pods; a step asking the config again
    # would raise here.
    def asked(_self: ReplicationConfig) -> bool:
        raise AssertionError("a Train read trainer.replication after the engine was built")

    monkeypatch.setattr(ReplicationConfig, "enabled", property(asked))
    assert served.stub.Train(make_request(1), timeout=60).policy_version == 1
    assert served.engine.replicated is False


def test_a_weight_sync_runs_none_of_the_engines_code(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PublishWeights and AcknowledgeWeights read the engine's model and train state; a call of
    # one of the engine's own functions (here: its policy_version property) would raise.
    def asked(_self: TrainerEngine) -> int:
        raise AssertionError("a weight sync ran the engine's code")

    monkeypatch.setattr(TrainerEngine, "policy_version", property(asked))
    published = served.stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    assert published.manifest.version == 0
    served.stub.AcknowledgeWeights(trainer_pb2.AcknowledgeWeightsRequest(version=0), timeout=60)
    assert served.sync.publisher.pending_version is None


def test_the_servicer_is_built_from_the_trainer_section_the_run_dir_and_the_pod_id(
    served: Served, tmp_path: Path
) -> None:
    # No RunConfig: the servicer reads the trainer's section, and of the rest only these two.
    servicer = TrainerServicer(
        TrainerConfig(loss_mode="dr_grpo"),
        run_dir=tmp_path / "elsewhere",
        worker_id="pod-7",
        engine=served.engine,
        loop=served.loop,
    )
    info = servicer.Info(common_pb2.InfoRequest(), None)  # type: ignore[arg-type]
    assert (info.info.worker_id, info.info.details["loss_mode"]) == ("pod-7", "dr_grpo")
