"""The Train call of a step: applied at most once, and recorded only as far as it is known.

The contract with the trainer: ``TrainRequest.batch_id`` names the batch (run, controller
process, step, attempt); a Train whose batch_id equals the trainer's last applied one is answered
with that step's stored reply and trains nothing; ``TrainerInfo.last_batch_id`` and
``last_train`` tell which batch the trainer applied last, and its reply. The trainer also refuses
(INVALID_ARGUMENT) a request that expects another policy version than the one it holds.

When a Train call fails, the controller asks the trainer's Info and :func:`judge_train_failure`
decides:

- the trainer's ``last_batch_id`` is this batch → applied; the step records ``last_train``'s
  (measured) metrics;
- the trainer is one version ahead and keeps no batch id ("": a trainer without the contract) →
  applied by this request (the trainer's version is checked before the first send, and the
  controller never has two batches for one version in flight); the trainer metrics are
  recorded as unknown (null), never as 0.0;
- one version ahead while ``last_batch_id`` names another batch → the same request is sent
  again: the trainer bumps its version a moment before it stores the batch id, so Info can show
  the one without the other; the re-send is answered from the stored reply if the batch was
  this one, and refused for its version otherwise (then, once the sends are used up, the run
  fails);
- the version unchanged and the trainer answered (the call is over) → not applied: the attempt
  fails and the step is retried from scratch; INVALID_ARGUMENT fails the run (a bad batch is a
  bug, retrying cannot help);
- the version unchanged but the outcome unknown (deadline, transport failure: the trainer may
  still be computing it), or the trainer does not answer Info → the SAME request is sent again
  (never regenerated: a second batch for the same version could train twice). The trainer runs
  one Train at a time, so the re-sent one waits for the first and is then answered from its
  stored reply;
- any other version → the run fails.

After ``attempts`` sends with the outcome still unknown the run fails; the step in flight stays
in SQLite and a restart resolves it (``podrl.controller.resume``).
"""

from __future__ import annotations

import enum
import logging
import threading
from dataclasses import dataclass

import grpc

from podrl.controller.clients import WorkerClients
from podrl.controller.step_errors import (
    TRANSPORT_FAILURES,
    RunFailedError,
    StepFailedError,
    describe_rpc_error,
)
from podrl.v1 import common_pb2, trainer_pb2

log = logging.getLogger(__name__)

#: The call may still be running on the trainer (as opposed to an answer that ended it).
OUTCOME_UNKNOWN = (*TRANSPORT_FAILURES, grpc.StatusCode.CANCELLED)


class Verdict(enum.Enum):
    APPLIED = "applied"
    """Applied, and the trainer's stored reply for this batch is known."""
    APPLIED_METRICS_UNKNOWN = "applied, metrics unknown"
    NOT_APPLIED = "not applied"
    """The trainer answered and still holds the expected version: retry the step."""
    RESEND = "resend"
    """Outcome unknown: send the same request again."""
    FAIL_RUN = "fail run"


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    reason: str


def judge_train_failure(
    code: grpc.StatusCode,
    details: str,
    request: trainer_pb2.TrainRequest,
    info: trainer_pb2.TrainerInfo | None,
) -> Judgement:
    """What a failed Train call means, given the trainer's Info right after it (None when Info
    failed too). Pure: the table in the module docstring."""
    expected = request.policy_version
    if info is None:
        return Judgement(Verdict.RESEND, "the trainer does not answer Info")
    if request.batch_id and info.last_batch_id == request.batch_id:
        return Judgement(Verdict.APPLIED, f"the trainer's last batch is {request.batch_id}")
    if info.policy_version == expected + 1:
        if info.last_batch_id:
            return Judgement(
                Verdict.RESEND,
                f"the trainer is at version {info.policy_version} and names batch "
                f"{info.last_batch_id}, not this step's {request.batch_id} (yet)",
            )
        return Judgement(
            Verdict.APPLIED_METRICS_UNKNOWN,
            f"the trainer is at version {info.policy_version} and reports no batch id",
        )
    if info.policy_version != expected:
        return Judgement(
            Verdict.FAIL_RUN,
            f"the trainer reports version {info.policy_version} (expected {expected}); restart "
            "the run to resume from its records and checkpoints",
        )
    if code in OUTCOME_UNKNOWN:
        return Judgement(Verdict.RESEND, f"{code.name} with the version unchanged")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return Judgement(Verdict.FAIL_RUN, f"the trainer rejected the batch: {details}")
    return Judgement(Verdict.NOT_APPLIED, f"{code.name}: {details}")


@dataclass(frozen=True)
class TrainOutcome:
    """An applied Train: the reply, and whether its metrics are the trainer's measurements."""

    reply: trainer_pb2.TrainResponse
    metrics_known: bool
    sends: int
    """How many times the request was sent (1 unless a reply was lost)."""


class TrainPhase:
    def __init__(
        self,
        clients: WorkerClients,
        attempts: int,
        stop: threading.Event | None = None,
        backoff_seconds: float = 2.0,
    ) -> None:
        self._clients = clients
        self._attempts = attempts
        self._backoff = backoff_seconds
        """The wait before re-send k is k times this (at most 10 s)."""
        self.stop = stop or threading.Event()
        """Set when the run stops: waits between re-sends end early."""

    def trainer_info(self, address: str) -> trainer_pb2.TrainerInfo | None:
        try:
            return self._clients.trainer(address).Info(
                common_pb2.InfoRequest(), timeout=self._clients.short
            )
        except grpc.RpcError:
            return None

    def train(self, address: str, request: trainer_pb2.TrainRequest) -> TrainOutcome:
        """Send ``request`` until its outcome is known; see the module docstring."""
        expected = request.policy_version
        stub = self._clients.trainer(address)
        before = self.trainer_info(address)
        if before is not None and before.policy_version != expected:
            # Checked first so that "one version ahead after a failed call" can only mean
            # that this request was applied.
            raise RunFailedError(
                f"trainer {address} is at policy version {before.policy_version} before this "
                f"step's Train (expected {expected}, last batch {before.last_batch_id or 'none'})"
                "; restart the run to resume from its records and checkpoints"
            )
        for send in range(1, self._attempts + 1):
            try:
                reply = stub.Train(request, timeout=self._clients.long)
            except grpc.RpcError as err:
                info = self.trainer_info(address)
                judgement = judge_train_failure(err.code(), err.details() or "", request, info)
                log.warning(
                    "Train of batch %s (send %d/%d) failed with %s: %s → %s",
                    request.batch_id,
                    send,
                    self._attempts,
                    describe_rpc_error(err),
                    judgement.reason,
                    judgement.verdict.value,
                )
                verdict = judgement.verdict
                if verdict is Verdict.APPLIED:
                    assert info is not None
                    return self._checked(info.last_train, expected, send, measured=True)
                if verdict is Verdict.APPLIED_METRICS_UNKNOWN:
                    assert info is not None
                    unknown = trainer_pb2.TrainResponse(policy_version=info.policy_version)
                    return self._checked(unknown, expected, send, measured=False)
                if verdict is Verdict.NOT_APPLIED:
                    raise StepFailedError("train", judgement.reason) from err
                if verdict is Verdict.FAIL_RUN:
                    raise RunFailedError(
                        f"trainer {address} failed during Train ({describe_rpc_error(err)}): "
                        f"{judgement.reason}"
                    ) from err
                if send == self._attempts:
                    raise RunFailedError(
                        f"Train of batch {request.batch_id} on trainer {address}: outcome still "
                        f"unknown after {send} sends ({judgement.reason}; last error "
                        f"{describe_rpc_error(err)}); a restart finds out from the trainer "
                        "whether the step was applied"
                    ) from err
                self.stop.wait(min(self._backoff * send, 10.0))
                continue
            return self._checked(reply, expected, send, measured=True)
        raise AssertionError("unreachable: the loop returns or raises")

    @staticmethod
    def _checked(
        reply: trainer_pb2.TrainResponse, expected: int, sends: int, *, measured: bool
    ) -> TrainOutcome:
        if reply.policy_version != expected + 1:
            raise RunFailedError(
                f"the trainer answered Train with policy version {reply.policy_version}, "
                f"expected {expected + 1}"
            )
        return TrainOutcome(reply, measured, sends)
