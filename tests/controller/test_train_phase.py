"""A step's Train is applied at most once, and recorded only as far as it is known.

The decision table is tested as a pure function; the re-send path runs against a fake trainer
over real gRPC (tests/controller/fake_workers.py) with real deadlines.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from podrl.config.transport import GrpcConfig
from podrl.controller.step.pod_calls import (
    TrainOutcome,
    TrainPhase,
    Verdict,
    WorkerClients,
    judge_train_failure,
)
from podrl.controller.step_errors import RunFailedError, StepFailedError
from podrl.v1 import trainer_pb2
from tests.controller.fake_workers import FakePod, FakeReplicaGroup, TrainFault

Code = grpc.StatusCode
DEADLINE = 0.5


def _request(version: int = 3, batch_id: str = "run:abc:4:1") -> trainer_pb2.TrainRequest:
    return trainer_pb2.TrainRequest(
        sequences=[trainer_pb2.TrainSequence(sample_id="p#0", completion_ids=[1, 2])],
        policy_version=version,
        batch_id=batch_id,
    )


def _info(version: int, batch_id: str = "") -> trainer_pb2.TrainerInfo:
    return trainer_pb2.TrainerInfo(policy_version=version, last_batch_id=batch_id)


@pytest.mark.parametrize(
    ("code", "info", "verdict"),
    [
        # The trainer names this batch as its last: applied, its stored reply is the record.
        (Code.DEADLINE_EXCEEDED, _info(4, "run:abc:4:1"), Verdict.APPLIED),
        (Code.INTERNAL, _info(4, "run:abc:4:1"), Verdict.APPLIED),
        # One version ahead, no batch ids kept: this request did it; metrics unknown.
        (Code.INVALID_ARGUMENT, _info(4), Verdict.APPLIED_METRICS_UNKNOWN),
        (Code.DEADLINE_EXCEEDED, _info(4), Verdict.APPLIED_METRICS_UNKNOWN),
        # One version ahead, the batch id not (yet) ours: ask again with the same request.
        (Code.INVALID_ARGUMENT, _info(4, "run:abc:3:1"), Verdict.RESEND),
        # Version unchanged and the call may still run: the same request again.
        (Code.DEADLINE_EXCEEDED, _info(3, "run:abc:3:1"), Verdict.RESEND),
        (Code.UNAVAILABLE, _info(3), Verdict.RESEND),
        (Code.CANCELLED, _info(3), Verdict.RESEND),
        (Code.DEADLINE_EXCEEDED, None, Verdict.RESEND),
        # Version unchanged and the trainer answered: nothing applied, retry the step.
        (Code.INTERNAL, _info(3), Verdict.NOT_APPLIED),
        (Code.FAILED_PRECONDITION, _info(3), Verdict.NOT_APPLIED),
        # A batch the trainer refuses outright is a bug.
        (Code.INVALID_ARGUMENT, _info(3), Verdict.FAIL_RUN),
        # The trainer is somewhere else entirely (restarted at 0, or jumped).
        (Code.UNAVAILABLE, _info(0), Verdict.FAIL_RUN),
        (Code.INTERNAL, _info(6), Verdict.FAIL_RUN),
    ],
)
def test_judge_train_failure(
    code: grpc.StatusCode, info: trainer_pb2.TrainerInfo | None, verdict: Verdict
) -> None:
    assert judge_train_failure(code, "details", _request(), info).verdict is verdict


def _train(phase: TrainPhase, pod: FakePod, request: trainer_pb2.TrainRequest) -> TrainOutcome:
    """One pod, one request, as the loop sends a step to a one-pod roster."""
    return phase.train_pods(
        {"local-0": pod.address},
        request.policy_version,
        lambda pods, round_no: {"local-0": request},
    )


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[FakePod]:
    pod = FakePod(tmp_path / "checkpoints")
    pod.trainer.version = 3
    yield pod
    pod.stop()


@pytest.fixture
def phase() -> Iterator[TrainPhase]:
    clients = WorkerClients(GrpcConfig(long_call_timeout_seconds=DEADLINE))
    yield TrainPhase(clients, attempts=3, backoff_seconds=0.05)
    clients.close()


def test_a_reply_lost_while_the_trainer_computes_is_resent_and_applied_once(
    pod: FakePod, phase: TrainPhase
) -> None:
    pod.trainer.faults = [TrainFault(delay_before_apply=DEADLINE * 3)]
    outcome = _train(phase, pod, _request())
    # The same batch was sent again (not a regenerated one), and trained once.
    assert outcome.sends >= 2
    assert pod.trainer.received == ["run:abc:4:1"] * outcome.sends
    assert len(pod.trainer.applied) == 1
    assert pod.trainer.version == 4
    assert outcome.metrics_known
    assert outcome.reply == pod.trainer.last_train


def test_a_trainer_without_batch_ids_gives_an_applied_step_with_unknown_metrics(
    pod: FakePod, phase: TrainPhase
) -> None:
    pod.trainer.keeps_batch_ids = False
    pod.trainer.faults = [TrainFault(delay_before_apply=DEADLINE * 3)]
    outcome = _train(phase, pod, _request())
    assert len(pod.trainer.applied) == 1  # the re-send was refused for its version
    assert outcome.reply.policy_version == 4
    assert not outcome.metrics_known


def test_an_update_followed_by_an_error_is_recorded_from_the_trainers_stored_reply(
    pod: FakePod, phase: TrainPhase
) -> None:
    pod.trainer.faults = [TrainFault(abort_after_apply=Code.INTERNAL)]
    outcome = _train(phase, pod, _request())
    assert outcome.sends == 1 and outcome.metrics_known
    assert outcome.reply.metrics.loss == pod.trainer.last_train.metrics.loss == 0.5
    assert len(pod.trainer.applied) == 1


def test_a_reply_lost_after_the_update_is_recorded_from_the_stored_reply(
    pod: FakePod, phase: TrainPhase
) -> None:
    pod.trainer.faults = [TrainFault(delay_after_apply=DEADLINE * 3)]
    outcome = _train(phase, pod, _request())
    assert outcome.metrics_known and outcome.reply == pod.trainer.last_train
    assert len(pod.trainer.applied) == 1


def test_a_refused_train_fails_the_attempt_and_trains_nothing(
    pod: FakePod, phase: TrainPhase
) -> None:
    pod.trainer.faults = [TrainFault(abort_before_apply=Code.INTERNAL)]
    with pytest.raises(StepFailedError) as failed:
        _train(phase, pod, _request())
    assert failed.value.phase == "train"
    assert pod.trainer.applied == [] and pod.trainer.version == 3


def test_a_batch_the_trainer_refuses_fails_the_run(pod: FakePod, phase: TrainPhase) -> None:
    pod.trainer.faults = [TrainFault(abort_before_apply=Code.INVALID_ARGUMENT)]
    with pytest.raises(RunFailedError, match="rejected the batch"):
        _train(phase, pod, _request())
    assert pod.trainer.applied == []


def test_a_trainer_ahead_before_the_first_send_fails_the_run_and_trains_nothing(
    pod: FakePod, phase: TrainPhase
) -> None:
    # Without the check, "one version ahead, no batch id" after the refused send would be
    # taken as this batch applied, and its samples recorded for an update they did not make.
    with pytest.raises(RunFailedError, match="at policy version 3 before this step's Train"):
        _train(phase, pod, _request(version=2))
    assert pod.trainer.received == []


def test_a_trainer_that_never_answers_fails_the_run_with_the_outcome_unknown(
    pod: FakePod, phase: TrainPhase
) -> None:
    pod.stop()
    with pytest.raises(RunFailedError, match="outcome still unknown after 3 sends"):
        _train(phase, pod, _request())


def test_a_version_advanced_by_another_batch_fails_the_run_once_the_sends_are_used_up(
    pod: FakePod, phase: TrainPhase
) -> None:
    # Another batch lands while this one's first send computes (a second controller, say).
    def other_batch_lands() -> None:
        pod.trainer.version, pod.trainer.last_batch_id = 4, "run:zzz:4:1"

    pod.trainer.faults = [TrainFault(abort_before_apply=Code.UNAVAILABLE)]
    pod.trainer.on_abort = other_batch_lands
    with pytest.raises(RunFailedError, match="names batch run:zzz:4:1, not this step's"):
        _train(phase, pod, _request())
    assert pod.trainer.applied == []
    assert pod.trainer.received == ["run:abc:4:1"] * 3


def test_a_pod_lost_before_its_quorum_has_its_peers_calls_cancelled_and_the_step_re_split(
    tmp_path: Path,
) -> None:
    # The quorum would wait a minute for the lost pod, and the calls' deadline is longer: only
    # the controller's cancellation ends the peer's wait early.
    group = FakeReplicaGroup(quorum_timeout=60)
    pods = {name: FakePod(tmp_path / name, name, group=group) for name in ("pod-0", "pod-1")}
    pods["pod-1"].kill()  # lost before its Train: it answers neither Train nor Info
    sequences = [
        trainer_pb2.TrainSequence(sample_id=f"p#{i}", completion_ids=[1]) for i in range(4)
    ]

    def requests_for(names: list[str], round_no: int) -> dict[str, trainer_pb2.TrainRequest]:
        share = len(sequences) // len(names)
        return {
            name: trainer_pb2.TrainRequest(
                sequences=sequences[i * share : (i + 1) * share],
                policy_version=0,
                batch_id=f"run:abc:1:1.{round_no}@{name}",
                pods=len(names),
                global_sequences=len(sequences),
                global_completion_tokens=len(sequences),
            )
            for i, name in enumerate(names)
        }

    clients = WorkerClients(GrpcConfig(long_call_timeout_seconds=120))
    lost: list[str] = []
    phase = TrainPhase(
        clients, attempts=3, backoff_seconds=0.05, on_lost=lambda pod, reason: lost.append(pod)
    )
    try:
        outcome = phase.train_pods({n: p.address for n, p in pods.items()}, 0, requests_for)
    finally:
        clients.close()
        for pod in pods.values():
            pod.stop()
    # pod-0 waited in the quorum for pod-1 until the controller cancelled its call.
    assert group.cancelled == ["run:abc:1:1.1@pod-0"]
    assert lost == ["pod-1"]
    # Then the step went to pod-0 alone, whole, and was applied once.
    assert outcome.sends == 2 and outcome.batch_ids == {"pod-0": "run:abc:1:1.2@pod-0"}
    survivor = pods["pod-0"].trainer
    assert [len(r.sequences) for r in survivor.applied] == [4] and survivor.version == 1
