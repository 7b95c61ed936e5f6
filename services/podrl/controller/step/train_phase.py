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
in SQLite and a restart resolves it (``podrl.controller.records.resume``).

With several pods, a pod lost mid-step (its trainer answers neither Train nor Info, or
restarted) has the other pods' calls cancelled: a trainer waiting for it in the step's quorum
then gives up at once with nothing stepped (instead of at ``quorum_timeout_seconds``), and the
step's batch is re-split over the pods left (``TrainPhase.train_pods``).
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from podrl.controller.pods.clients import WorkerClients
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
    restarted: bool = False
    """The trainer holds a version below the one it had before the call: a new process."""


def judge_train_failure(
    code: grpc.StatusCode,
    details: str,
    request: trainer_pb2.TrainRequest,
    info: trainer_pb2.TrainerInfo | None,
    held_before: int | None = None,
    earlier_batch_ids: frozenset[str] = frozenset(),
) -> Judgement:
    """What a failed Train call means, given the trainer's Info right after it (None when Info
    failed too). Pure: the table in the module docstring.

    ``held_before``: the trainer's version before the call (default: the request's). A joining
    trainer is behind and heals from a peer inside Train, so any version from ``held_before``
    to the request's counts as "not advanced"; one below ``held_before`` is a trainer that
    restarted. ``earlier_batch_ids``: the ids of this step's earlier rounds (also this step)."""
    expected = request.policy_version
    before = expected if held_before is None else held_before
    if info is None:
        return Judgement(Verdict.RESEND, "the trainer does not answer Info")
    if info.last_batch_id and (
        info.last_batch_id == request.batch_id or info.last_batch_id in earlier_batch_ids
    ):
        return Judgement(Verdict.APPLIED, f"the trainer's last batch is {info.last_batch_id}")
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
    if info.policy_version < before:
        return Judgement(
            Verdict.FAIL_RUN,
            f"the trainer reports version {info.policy_version} (expected {expected}): it "
            "restarted; restart the run to resume from its records and checkpoints",
            restarted=True,
        )
    if info.policy_version > expected:
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
    """The step's record: the first pod's (in roster order) whose metrics are measured."""
    metrics_known: bool
    sends: int
    """How many times the step's requests were sent (1 unless a reply was lost or a pod died
    mid-step)."""
    replies: dict[str, trainer_pb2.TrainResponse] = field(default_factory=dict)
    """Pod id → its reply, for every pod whose trainer applied the step."""
    batch_ids: dict[str, str] = field(default_factory=dict)
    """Pod id → the batch id it applied."""


#: Builds the step's requests for a set of pods: round 1, and again (re-split, new batch ids)
#: after a pod was lost. Pod id → its request.
RequestsFor = Callable[[list[str], int], dict[str, trainer_pb2.TrainRequest]]


@dataclass
class _PodResult:
    pod: str
    request: trainer_pb2.TrainRequest
    reply: trainer_pb2.TrainResponse | None = None
    measured: bool = True
    judgement: Judgement | None = None
    error: grpc.RpcError | None = None
    lost: bool = False


def trainer_info(clients: WorkerClients, address: str) -> trainer_pb2.TrainerInfo | None:
    """The trainer's Info; None when it does not answer."""
    try:
        return clients.trainer(address).Info(common_pb2.InfoRequest(), timeout=clients.short)
    except grpc.RpcError:
        return None


class TrainPhase:
    def __init__(
        self,
        clients: WorkerClients,
        attempts: int,
        stop: threading.Event | None = None,
        backoff_seconds: float = 2.0,
        on_lost: Callable[[str, str], None] = lambda pod, reason: None,
    ) -> None:
        self._clients = clients
        self._attempts = attempts
        self._backoff = backoff_seconds
        """The wait before re-send k is k times this (at most 10 s)."""
        self.stop = stop or threading.Event()
        """Set when the run stops: waits between re-sends end early."""
        self._on_lost = on_lost
        """Called with (pod id, reason) for a pod whose trainer was lost mid-step."""

    def trainer_info(self, address: str) -> trainer_pb2.TrainerInfo | None:
        return trainer_info(self._clients, address)

    def train_pods(
        self, trainers: dict[str, str], expected: int, requests_for: RequestsFor
    ) -> TrainOutcome:
        """Train the step on every pod of ``trainers`` (pod id → trainer address, in roster
        order) at once, each with its share, until its outcome is known.

        - every pod's trainer applied it → its replies;
        - a pod was lost (its trainer does not answer, or restarted) while the others answered
          "not applied" (ABORTED: a peer died, nothing changed) → the lost pods leave and the
          step's batch is re-split over the rest and sent again with new batch ids, so the step
          is trained exactly once;
        - any trainer applied it → applied (pods that did not heal from a peer at the next
          step);
        - outcome unknown (a lost reply) on a pod still there → the same requests are sent
          again to the same pods (a trainer answers a repeated batch id from its stored
          reply);
        - every pod answered "not applied" → ``StepFailedError`` (the attempt is retried);
          a refused batch or a trainer somewhere else → ``RunFailedError``.
        """
        pods = list(trainers)
        before = self._versions_before(trainers, pods, expected)
        round_no, sends = 1, 0
        requests = requests_for(pods, round_no)
        earlier: set[str] = set()
        while True:
            sends += 1
            results = self._send(trainers, requests, before, frozenset(earlier))
            applied = [r for r in results if r.reply is not None]
            if applied:
                for result in results:
                    if result.reply is None:
                        self._log_left_behind(result)
                    if result.lost and len(pods) > 1:
                        self._on_lost(result.pod, f"train: {result.judgement.reason}")
                return self._applied(applied, expected, sends)
            failing = [r for r in results if r.judgement is not None]
            run_fail = [
                r
                for r in failing
                if r.judgement.verdict is Verdict.FAIL_RUN and not r.judgement.restarted
            ]
            if run_fail:
                first = run_fail[0]
                raise RunFailedError(
                    f"trainer {trainers[first.pod]} failed during Train "
                    f"({describe_rpc_error(first.error)}): {first.judgement.reason}"
                ) from first.error
            lost = [r for r in failing if r.lost]
            survivors = [p for p in pods if p not in {r.pod for r in lost}]
            if lost and survivors:
                for result in lost:
                    self._on_lost(result.pod, f"train: {result.judgement.reason}")
                if sends >= self._attempts:
                    raise StepFailedError(
                        "train",
                        f"pods were lost mid-step {sends} times (last: {lost[0].pod}: "
                        f"{lost[0].judgement.reason})",
                    )
                earlier |= {r.batch_id for r in requests.values()}
                pods, round_no = survivors, round_no + 1
                requests = requests_for(pods, round_no)
                log.warning(
                    "Train: pods %s lost mid-step; the batch is re-split over %s (round %d)",
                    [r.pod for r in lost],
                    pods,
                    round_no,
                )
                continue
            restarted = [r for r in failing if r.judgement.restarted]
            if restarted:
                first = restarted[0]
                raise RunFailedError(
                    f"trainer {trainers[first.pod]} failed during Train "
                    f"({describe_rpc_error(first.error)}): {first.judgement.reason}"
                ) from first.error
            resend = [r for r in failing if r.judgement.verdict is Verdict.RESEND]
            if resend:
                first = resend[0]
                if sends >= self._attempts:
                    raise RunFailedError(
                        f"Train of batch {first.request.batch_id} on trainer "
                        f"{trainers[first.pod]}: outcome still unknown after {sends} sends "
                        f"({first.judgement.reason}; last error "
                        f"{describe_rpc_error(first.error)}); a restart finds out from the "
                        "trainer whether the step was applied"
                    ) from first.error
                self.stop.wait(min(self._backoff * sends, 10.0))
                continue
            first = failing[0]
            raise StepFailedError("train", first.judgement.reason) from first.error

    def _versions_before(
        self, trainers: dict[str, str], pods: list[str], expected: int
    ) -> dict[str, int]:
        """Each trainer's version before the first send. Checked first so that "one version
        ahead after a failed call" can only mean that this step's request was applied."""
        before: dict[str, int] = {}
        for pod in pods:
            info = self.trainer_info(trainers[pod])
            if info is None:
                continue  # judged after the send
            if info.policy_version > expected:
                raise RunFailedError(
                    f"trainer {trainers[pod]} is at policy version {info.policy_version} "
                    f"before this step's Train (expected {expected}, last batch "
                    f"{info.last_batch_id or 'none'}); restart the run to resume from its "
                    "records and checkpoints"
                )
            before[pod] = info.policy_version
        if before and expected not in before.values():
            pod, version = next(iter(before.items()))
            raise RunFailedError(
                f"trainer {trainers[pod]} is at policy version {version} before this step's "
                f"Train (expected {expected}) and no trainer holds version {expected} to heal "
                "it from; restart the run to resume from its records and checkpoints"
            )
        return before

    def _send(
        self,
        trainers: dict[str, str],
        requests: dict[str, trainer_pb2.TrainRequest],
        before: dict[str, int],
        earlier: frozenset[str],
    ) -> list[_PodResult]:
        """Send every pod its request at once; judge each answer as it comes.

        A pod found lost (its trainer does not answer Info either, or restarted) gets the
        calls of the pods still training cancelled: a peer that waits for it in the step's
        quorum would wait ``quorum_timeout_seconds`` (120 s by default) for a pod that will not
        come. The peer then answers with nothing stepped (the quorum cannot hold the step
        without the lost pod's share); one already past the quorum finishes as it would, and
        its lost reply is judged from its Info like any other (``judge_train_failure``)."""
        calls = {
            pod: self._clients.trainer(trainers[pod]).Train.future(
                request, timeout=self._clients.long
            )
            for pod, request in requests.items()
        }
        answered: queue.SimpleQueue[str] = queue.SimpleQueue()
        for pod, call in calls.items():
            call.add_done_callback(lambda _call, pod=pod: answered.put(pod))
        results: dict[str, _PodResult] = {}
        while len(results) < len(calls):
            pod = answered.get()
            result = results[pod] = self._judge(
                pod, trainers[pod], requests[pod], calls[pod], before, earlier
            )
            if result.lost:
                for other, call in calls.items():
                    if other not in results and call.cancel():
                        log.info("Train of pod %s cancelled: pod %s was lost", other, pod)
        return [results[pod] for pod in requests]

    def _judge(
        self,
        pod: str,
        address: str,
        request: trainer_pb2.TrainRequest,
        call: grpc.Future,
        before: dict[str, int],
        earlier: frozenset[str],
    ) -> _PodResult:
        """One pod's answer (``call``: its finished Train future) as a result."""
        result = _PodResult(pod, request)
        try:
            result.reply = call.result()
            return result
        except (grpc.RpcError, grpc.FutureCancelledError):
            result.error = call  # the future is the call: code() and details() of its end
        info = self.trainer_info(address)
        code = result.error.code()
        judgement = judge_train_failure(
            code,
            result.error.details() or "",
            request,
            info,
            held_before=before.get(pod),
            earlier_batch_ids=earlier,
        )
        log.warning(
            "Train of batch %s failed with %s: %s → %s",
            request.batch_id,
            describe_rpc_error(result.error),
            judgement.reason,
            judgement.verdict.value,
        )
        if judgement.verdict is Verdict.APPLIED:
            assert info is not None
            result.reply = info.last_train
        elif judgement.verdict is Verdict.APPLIED_METRICS_UNKNOWN:
            assert info is not None
            result.reply = trainer_pb2.TrainResponse(policy_version=info.policy_version)
            result.measured = False
        else:
            result.judgement = judgement
            # No answer to Info either: the trainer is gone (or out of reach) for now.
            result.lost = judgement.restarted or info is None
        return result

    @staticmethod
    def _log_left_behind(result: _PodResult) -> None:
        assert result.judgement is not None
        log.warning(
            "pod %s did not apply batch %s while others did (%s): it heals from a peer in its "
            "next Train",
            result.pod,
            result.request.batch_id,
            result.judgement.reason,
        )

    @staticmethod
    def _applied(results: list[_PodResult], expected: int, sends: int) -> TrainOutcome:
        for result in results:
            assert result.reply is not None
            if result.reply.policy_version != expected + 1:
                raise RunFailedError(
                    f"the trainer of pod {result.pod} answered Train with policy version "
                    f"{result.reply.policy_version}, expected {expected + 1}"
                )
        record = next((r for r in results if r.measured), results[0])
        assert record.reply is not None
        return TrainOutcome(
            reply=record.reply,
            metrics_known=record.measured,
            sends=sends,
            replies={r.pod: r.reply for r in results if r.reply is not None},
            batch_ids={r.pod: r.request.batch_id for r in results},
        )
