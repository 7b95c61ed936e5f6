"""The controller's calls to the pods' services: one cached channel per worker address with a
deadline on every call (:class:`WorkerClients`), the generate and score fan-outs over the step's
pods (:class:`WorkerPhases`), the Train calls of a step (:class:`TrainPhase`) and the weight sync
inside each pod (:class:`WeightSync`). Which pods take part is the pod table's
(pods/table.py); what the calls carry is step/batch.py's.

**Generate and score** (:class:`WorkerPhases`): fan-outs over the step's pods, and the checks
that their replies are whole before anything is trained on them.

Each pod generates its share of the step's prompts on its own generator (a prompt's group never
spans pods) and scores those samples on its own grader. A pod that is lost meanwhile (a call
failed at the transport level, or it is draining or terminating) leaves the roster; what it
already returned is kept, and its unfinished share is done by the remaining pods in the same
phase. Any other failure, or no pod left, raises ``StepFailedError``: the loop then throws the
attempt away and retries the step with the same prompts.

**Train** (:class:`TrainPhase`): applied at most once, and recorded only as far as it is known.

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

**Weight sync** (:class:`WeightSync`): a new policy version from each pod's trainer to that
pod's generator. It stays inside a pod: a pod's trainer publishes shared-memory (CPU) or CUDA
IPC (GPU) handles that only its own generator can open, and that generator trusts only its own
pod's trainer. So for every pod, in parallel: ``PublishWeights`` on its trainer →
``ApplyWeights`` on its generator → ``AcknowledgeWeights`` on its trainer, which may then update
the published storage again. The cost of a sync does not grow with the number of pods.

A generator that answers FAILED_PRECONDITION to a version-only manifest (restarted, no cached
plan, or needing a full manifest) is sent a full manifest. The trainers already hold the version
when a sync runs, so a failed sync is retried on its own, never by redoing the step; a pod that
is lost meanwhile is left out (its generator is aligned by a full manifest when it is admitted
again).

With ``loop.generator_memory: sleep_during_train`` (one accelerator shared by a pod's trainer
and generator) the generators sleep before Train (:meth:`WeightSync.sleep_pods`) and wake before
the sync (:meth:`WeightSync.wake_pods`, retried on its own as the sync is).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TypeVar

import grpc

from podrl.common.auth import CallerCredentials
from podrl.common.grpc_options import open_channel
from podrl.config.loop import SamplingConfig
from podrl.config.transport import GrpcConfig
from podrl.controller import loop_metrics as metrics
from podrl.controller.pods.table import Pod, PodTable
from podrl.controller.step.batch import StepSamples, sample_id
from podrl.controller.step_errors import (
    TRANSPORT_FAILURES,
    RunFailedError,
    StepFailedError,
    describe_rpc_error,
)
from podrl.tasks import PromptItem
from podrl.v1 import (
    common_pb2,
    environment_pb2_grpc,
    generator_pb2,
    generator_pb2_grpc,
    grader_pb2,
    grader_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weights_pb2,
)

T = TypeVar("T")
W = TypeVar("W")

log = logging.getLogger(__name__)

#: A call that failed with one of these lost its pod: unreachable, or the server went away
#: under the call (CANCELLED: the controller cancels none of its own calls).
POD_LOST = (*TRANSPORT_FAILURES, grpc.StatusCode.CANCELLED)

#: The Train call may still be running on the trainer (as opposed to an answer that ended it).
OUTCOME_UNKNOWN = (*TRANSPORT_FAILURES, grpc.StatusCode.CANCELLED)

#: GeneratorInfo.weight_state values of a generator that serves no settled version.
_UNSETTLED = ("needs_full", "applying")


# -- channels --------------------------------------------------------------------------------------
class WorkerClients:
    """One channel per worker address, reused across steps; closed on shutdown. Every call
    carries ``credentials`` (the controller's; None only when the run's auth is disabled)."""

    def __init__(self, config: GrpcConfig, credentials: CallerCredentials | None = None) -> None:
        self.config = config
        self.credentials = credentials
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(
                    address, self.config, self.credentials
                )
            return channel

    def generator(self, address: str) -> generator_pb2_grpc.GeneratorStub:
        return generator_pb2_grpc.GeneratorStub(self._channel(address))

    def grader(self, address: str) -> grader_pb2_grpc.GraderStub:
        return grader_pb2_grpc.GraderStub(self._channel(address))

    def trainer(self, address: str) -> trainer_pb2_grpc.TrainerStub:
        return trainer_pb2_grpc.TrainerStub(self._channel(address))

    def environment(self, address: str) -> environment_pb2_grpc.EnvironmentStub:
        return environment_pb2_grpc.EnvironmentStub(self._channel(address))

    @property
    def short(self) -> float:
        """Deadline of control calls."""
        return self.config.call_timeout_seconds

    @property
    def long(self) -> float:
        """Deadline of work calls (generate, score, train, checkpoint)."""
        return self.config.long_call_timeout_seconds

    def forget(self, address: str) -> None:
        """Drop the channel to ``address``: the process there was replaced (a channel to the
        old one may sit in reconnect backoff and fail calls to the new one at once)."""
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


# -- generate and score ----------------------------------------------------------------------------
#: Derived seeds stay below 2**62: vLLM seeds sample i with ``seed + i`` (n ≤ 1024), which then
#: fits a signed 64-bit integer (torch's generators take at most 2**64 - 1).
PROMPT_SEED_BITS = 62


def prompt_seed(seed: int, step: int, prompt_id: str) -> int:
    """The seed of one prompt's samples in ``step`` under the run's ``loop.sampling.seed``.

    A hash of the three (SHA-256, independent of PYTHONHASHSEED), not ``seed + step``: a prompt
    gets the same seed whichever pod generates it and after a resume (step numbers and prompt
    ids are restored), prompts of one step get different ones, and two runs whose seeds differ
    by one share no step's seeds. The top 62 bits of the digest: vLLM's sample ``i`` uses
    ``seed + i``, so different prompts' streams overlap only if two 62-bit hashes fall within
    ``n`` of each other."""
    digest = hashlib.sha256(f"{seed}:{step}:{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - PROMPT_SEED_BITS)


def split_round_robin(items: Sequence[T], parts: int) -> list[list[T]]:
    """Round-robin split into ``parts`` non-empty chunks (fewer when there are few items)."""
    chunks = [list(items[i::parts]) for i in range(parts)]
    return [chunk for chunk in chunks if chunk]


def settle(pool: ThreadPoolExecutor, calls: list[Callable[[], T]]) -> list[T | BaseException]:
    """Run ``calls`` concurrently and wait for every one: its result or what it raised, in
    order. Nothing is cancelled: a pod's reply is kept even when another pod's call failed, and
    no call is still running when it returns (a retry never overlaps the call it retries)."""
    futures = [pool.submit(call) for call in calls]
    wait(futures)
    return [f.exception() if f.exception() is not None else f.result() for f in futures]


class PodCallError(Exception):
    """One pod's call of a phase failed; ``lost`` when the pod itself is gone."""

    def __init__(self, pod: Pod, message: str, lost: bool) -> None:
        super().__init__(message)
        self.pod = pod
        self.lost = lost


class WorkerPhases:
    """Generate and Score over the step's pods."""

    def __init__(
        self,
        clients: WorkerClients,
        pool: ThreadPoolExecutor,
        table: PodTable,
    ) -> None:
        self.clients = clients
        self.pool = pool
        self.table = table

    def on_rpc_failure(self, address: str, err: grpc.RpcError) -> None:
        """A worker that cannot be reached is taken out until it heartbeats again."""
        if err.code() in POD_LOST:
            self.table.mark_unreachable(address)

    def _pod_error(self, pod: Pod, what: str, address: str, err: grpc.RpcError) -> PodCallError:
        self.on_rpc_failure(address, err)
        lost = err.code() in POD_LOST or not self.table.usable(pod)
        return PodCallError(pod, f"{what} {address}: {describe_rpc_error(err)}", lost)

    def _spread(
        self,
        phase: str,
        assigned: list[tuple[Pod, list[W]]],
        call: Callable[[Pod, list[W]], None],
    ) -> None:
        """Run ``call(pod, work)`` for every assignment; the work of a pod that is lost is
        spread round-robin over the pods left and run again, until all of it is done."""
        live = [pod for pod, _ in assigned]
        while assigned:
            outcomes = settle(self.pool, [lambda p=p, w=w: call(p, w) for p, w in assigned])
            pending: list[W] = []
            first_error: PodCallError | None = None
            for (pod, work), outcome in zip(assigned, outcomes, strict=True):
                if not isinstance(outcome, BaseException):
                    continue
                if not isinstance(outcome, PodCallError):
                    raise outcome
                if not outcome.lost:
                    raise StepFailedError(phase, str(outcome)) from outcome
                first_error = first_error or outcome
                self.table.drop(pod.id, f"{phase}: {outcome}")
                live.remove(pod)
                pending.extend(work)
            if not pending:
                return
            live = [pod for pod in live if self.table.usable(pod)]
            if not live:
                assert first_error is not None
                raise StepFailedError(phase, f"{first_error}; no pod left to take its share")
            chunks = split_round_robin(pending, len(live))
            assigned = list(zip(live, chunks, strict=False))

    def _check_pods(self, pods: list[Pod]) -> list[Pod]:
        """The pods still usable; the others leave the roster now (drained, terminating)."""
        kept = []
        for pod in pods:
            if self.table.usable(pod):
                kept.append(pod)
            else:
                self.table.drop(pod.id, "draining, terminating or no longer healthy")
        return kept

    # -- generate ----------------------------------------------------------------------------
    def generate(
        self,
        step: int,
        data: StepSamples,
        sampling: SamplingConfig,
        policy_version: int | None,
        pods: list[Pod],
    ) -> None:
        """``sampling.n`` samples of every prompt into ``data.samples``, each prompt on one of
        ``pods`` (recorded in ``data.pod_of``), seeded by ``prompt_seed`` when ``sampling.seed``
        is set; every one must come back, sampled by
        ``policy_version`` (None, in async mode: by whichever version the pod's generator holds,
        one version per group; the consumer judges its staleness)."""
        pods = self._check_pods(pods)
        if not pods:
            raise StepFailedError("generate", "no healthy pod can generate (none admitted)")
        params = common_pb2.SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop=sampling.stop,
        )
        seeds = {
            item.id: None if sampling.seed is None else prompt_seed(sampling.seed, step, item.id)
            for item in data.items
        }

        def call(pod: Pod, chunk: list[PromptItem]) -> None:
            request = generator_pb2.GenerateRequest(
                prompts=[
                    common_pb2.Prompt(
                        id=item.id,
                        text=item.prompt,
                        task=item.task,
                        reference=item.reference,
                        metadata=item.metadata,
                        seed=seeds[item.id],
                    )
                    for item in chunk
                ],
                sampling=params,
                request_id=f"step-{step}",
            )
            try:
                reply = self.clients.generator(pod.generator).Generate(
                    request, timeout=self.clients.long
                )
            except grpc.RpcError as err:
                raise self._pod_error(pod, "generator", pod.generator, err) from err
            for item in chunk:
                data.samples.pop(item.id, None)
                data.pod_of[item.id] = pod.id
            for sample in reply.samples:
                data.samples.setdefault(sample.prompt_id, []).append(sample)

        chunks = split_round_robin(data.items, len(pods))
        self._spread("generate", list(zip(pods, chunks, strict=False)), call)
        self.table.note_shares(prompts=data.prompts_by_pod())
        for item in data.items:
            group = data.samples.get(item.id, [])
            if len(group) != sampling.n:
                raise StepFailedError(
                    "generate", f"prompt {item.id}: {len(group)} samples, expected {sampling.n}"
                )
            if policy_version is None:
                versions = sorted({x.policy_version for x in group})
                if len(versions) > 1:
                    raise StepFailedError(
                        "generate", f"prompt {item.id}: one group sampled by versions {versions}"
                    )
                continue
            stale = [x.policy_version for x in group if x.policy_version != policy_version]
            if stale:
                raise StepFailedError(
                    "generate",
                    f"prompt {item.id}: sampled by policy version {stale[0]}, expected "
                    f"{policy_version}",
                )

    # -- score -------------------------------------------------------------------------------
    def score(self, data: StepSamples, pods: list[Pod]) -> None:
        """A score for every sample into ``data.scores`` (a failed score is still a score: its
        ``error`` says so, and ``podrl.controller.step.batch`` leaves it out of training). Each pod
        scores the samples it generated; those of a pod gone since are spread over the rest."""
        pods = self._check_pods(pods)
        if not pods:
            raise StepFailedError("score", "no healthy pod can score (none left)")
        items_by_prompt = {
            item.id: [
                item.score_item(sample.text, sample_id(item.id, sample.index))
                for sample in data.samples[item.id]
            ]
            for item in data.items
        }

        def call(pod: Pod, prompt_ids: list[str]) -> None:
            chunk = [score_item for pid in prompt_ids for score_item in items_by_prompt[pid]]
            try:
                reply = self.clients.grader(pod.grader).Score(
                    grader_pb2.ScoreRequest(items=chunk), timeout=self.clients.long
                )
            except grpc.RpcError as err:
                raise self._pod_error(pod, "grader", pod.grader, err) from err
            for score in reply.scores:
                data.scores[score.id] = score

        by_pod: dict[str, list[str]] = {pod.id: [] for pod in pods}
        orphans: list[str] = []
        for item in data.items:
            owner = data.pod_of.get(item.id)
            by_pod.get(owner or "", orphans).append(item.id)
        for i, prompt_id in enumerate(orphans):
            by_pod[pods[i % len(pods)].id].append(prompt_id)
        assigned = [(pod, by_pod[pod.id]) for pod in pods if by_pod[pod.id]]
        self._spread("score", assigned, call)
        missing = [
            score_item.id
            for group in items_by_prompt.values()
            for score_item in group
            if score_item.id not in data.scores
        ]
        if missing:
            raise StepFailedError("score", f"{len(missing)} samples unscored, e.g. {missing[0]}")


# -- Train ----------------------------------------------------------------------------------------
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


# -- weight sync ----------------------------------------------------------------------------------
class WeightSync:
    def __init__(
        self,
        clients: WorkerClients,
        pool: ThreadPoolExecutor,
        stop: threading.Event | None = None,
        applying: Callable[[], AbstractContextManager[object]] = nullcontext,
        in_flight: bool = False,
    ) -> None:
        self._clients = clients
        self._pool = pool
        self.stop = stop or threading.Event()
        """Set when the run stops: retries end early."""
        self._applying = applying
        """Held around every ``ApplyWeights`` (async mode: the loop's side of the generator
        gate, so a generator is never given weights in the middle of a batch); the trainers'
        publish and acknowledgment run outside it."""
        self.in_flight = in_flight
        """``loop.weight_apply: in_flight``: every ApplyWeights but a rollback asks the
        generator to apply while its Generate calls run, and holds nothing here."""

    def sync(
        self, pod: Pod, version: int, force_full: bool = False, rollback: bool = False
    ) -> None:
        """The pod's trainer publishes, its generator applies, the trainer hears the
        acknowledgment. ``rollback``: the generator may hold a newer version (the trainer went
        back to a checkpoint)."""
        trainer = self._clients.trainer(pod.trainer)
        manifest = self._publish(pod, trainer, version, force_full or rollback)
        in_flight = self.in_flight and not rollback  # a rollback lands between batches
        with nullcontext() if in_flight else self._applying():
            self._apply(pod, trainer, version, manifest, rollback, in_flight)
        self._acknowledge(pod, trainer, version)

    def _apply(
        self,
        pod: Pod,
        trainer: trainer_pb2_grpc.TrainerStub,
        version: int,
        manifest: weights_pb2.WeightManifest,
        rollback: bool,
        in_flight: bool,
    ) -> None:
        stub = self._clients.generator(pod.generator)
        request = generator_pb2.ApplyWeightsRequest(
            manifest=manifest, rollback=rollback, in_flight=in_flight
        )
        try:
            stub.ApplyWeights(request, timeout=self._clients.long)
        except grpc.RpcError as err:
            # A restarted or new generator has no cached plan: send it the full manifest.
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION or not manifest.version_only:
                raise StepFailedError(
                    "sync", f"generator {pod.generator}: {describe_rpc_error(err)}"
                ) from err
            full = self._publish(pod, trainer, version, force_full=True)
            try:
                stub.ApplyWeights(
                    generator_pb2.ApplyWeightsRequest(manifest=full, in_flight=in_flight),
                    timeout=self._clients.long,
                )
            except grpc.RpcError as err:
                raise StepFailedError(
                    "sync", f"generator {pod.generator}: {describe_rpc_error(err)}"
                ) from err

    def _publish(
        self, pod: Pod, trainer: trainer_pb2_grpc.TrainerStub, version: int, force_full: bool
    ) -> weights_pb2.WeightManifest:
        try:
            published = trainer.PublishWeights(
                trainer_pb2.PublishWeightsRequest(force_full=force_full),
                timeout=self._clients.long,
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "sync", f"trainer {pod.trainer} PublishWeights: {describe_rpc_error(err)}"
            ) from err
        if published.manifest.version != version:
            raise StepFailedError(
                "sync",
                f"trainer {pod.trainer} published version {published.manifest.version}, "
                f"expected {version}",
            )
        return published.manifest

    def _acknowledge(self, pod: Pod, trainer: trainer_pb2_grpc.TrainerStub, version: int) -> None:
        try:
            trainer.AcknowledgeWeights(
                trainer_pb2.AcknowledgeWeightsRequest(version=version, generator_id="controller"),
                timeout=self._clients.short,
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "sync", f"trainer {pod.trainer} AcknowledgeWeights: {describe_rpc_error(err)}"
            ) from err

    def sync_with_retries(
        self,
        pod: Pod,
        version: int,
        attempts: int,
        is_lost: Callable[[Pod], bool] = lambda pod: False,
        align: bool = False,
    ) -> float | None:
        """The trainer already holds ``version``: a failed sync is retried on its own (redoing
        the step would train on its prompts twice). Republishing a pending version is allowed,
        and a generator that already applied it answers the retry with success. ``align``: the
        generator's version is unknown (its pod just joined): :meth:`bring_generator_to`.
        Returns the seconds of the sync that succeeded, or None when ``is_lost(pod)`` says the
        pod is gone (it is aligned when admitted again)."""

        def attempt() -> None:
            if align:
                self.bring_generator_to(pod, version)
            else:
                self.sync(pod, version)

        return self._retried(
            "sync",
            f"weight sync of version {version}",
            "a restart resumes after the trained step and re-syncs the generators",
            pod,
            attempts,
            is_lost,
            attempt,
        )

    def _retried(
        self,
        phase: str,
        what: str,
        after_failure: str,
        pod: Pod,
        attempts: int,
        is_lost: Callable[[Pod], bool],
        call: Callable[[], None],
    ) -> float | None:
        """``call`` until it succeeds (its seconds), the pod is lost (None), or ``attempts``
        failures (RunFailedError naming ``what`` and ``after_failure``); each failure counts
        as one of ``phase``."""
        for attempt in range(1, attempts + 1):
            start = time.perf_counter()
            try:
                call()
                return time.perf_counter() - start
            except StepFailedError as err:
                metrics.STEP_FAILURES.labels(phase).inc()
                log.error("%s on pod %s, attempt %d failed: %s", what, pod.id, attempt, err)
                if is_lost(pod):
                    log.warning("pod %s is gone: its %s is dropped", pod.id, what)
                    return None
                if attempt == attempts or self.stop.is_set():
                    raise RunFailedError(
                        f"{what} on pod {pod.id} failed {attempt} times ({err}); {after_failure}"
                    ) from err
                self.stop.wait(min(2.0 * attempt, 10.0))
        raise AssertionError("unreachable: the loop returns or raises")

    def sync_pods(
        self,
        pods: list[Pod],
        version: int,
        attempts: int,
        is_lost: Callable[[Pod], bool] = lambda pod: False,
        align: frozenset[str] = frozenset(),
    ) -> dict[str, float]:
        """Every pod syncs its own generator, all at once (those in ``align`` by
        :meth:`bring_generator_to`). Pod id → seconds of its sync (pods lost meanwhile are
        left out)."""
        return self._every_pod(
            pods,
            lambda pod: self.sync_with_retries(pod, version, attempts, is_lost, pod.id in align),
        )

    def wake_pods(
        self, pods: list[Pod], attempts: int, is_lost: Callable[[Pod], bool] = lambda pod: False
    ) -> dict[str, float]:
        """Every pod's generator wakes from sleep mode (a no-op for one awake), all at once,
        each retried on its own as a sync is: the trainers already trained the step. Pod id →
        seconds (pods lost meanwhile are left out)."""
        return self._every_pod(
            pods,
            lambda pod: self._retried(
                "wake",
                "WakeUp",
                "a restart wakes the generators before the next step",
                pod,
                attempts,
                is_lost,
                lambda: self.wake(pod),
            ),
        )

    def _every_pod(self, pods: list[Pod], call: Callable[[Pod], float | None]) -> dict[str, float]:
        futures = {pod.id: self._pool.submit(call, pod) for pod in pods}
        seconds: dict[str, float] = {}
        failure: BaseException | None = None
        for pod_id, future in futures.items():
            try:
                result = future.result()
            except BaseException as err:  # every pod's call ends before the failure is raised
                failure = failure or err
                continue
            if result is not None:
                seconds[pod_id] = result
        if failure is not None:
            raise failure
        return seconds

    def sleep_pods(self, pods: list[Pod], level: int = 1) -> None:
        """Every pod's generator goes to sleep (vLLM sleep mode), all at once, before Train
        (``loop.generator_memory: sleep_during_train``). Any failure fails the step attempt
        (StepFailedError, phase ``sleep``): nothing is trained yet, and the retry's align
        wakes the generators that did fall asleep."""
        futures = [self._pool.submit(self._sleep_one, pod, level) for pod in pods]
        outcomes = [future.result() for future in futures]
        failures = [
            f"generator {pod.generator}: {outcome}"
            for pod, outcome in zip(pods, outcomes, strict=True)
            if outcome is not None
        ]
        if failures:
            raise StepFailedError("sleep", "; ".join(failures))

    def _sleep_one(self, pod: Pod, level: int) -> str | None:
        try:
            self._clients.generator(pod.generator).Sleep(
                generator_pb2.SleepRequest(level=level), timeout=self._clients.long
            )
        except grpc.RpcError as err:
            return describe_rpc_error(err)
        return None

    def wake(self, pod: Pod) -> None:
        """The pod's generator leaves sleep mode (WakeUp is a no-op for one awake)."""
        try:
            self._clients.generator(pod.generator).WakeUp(
                generator_pb2.WakeUpRequest(), timeout=self._clients.long
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "wake", f"generator {pod.generator} WakeUp: {describe_rpc_error(err)}"
            ) from err

    def bring_generator_to(self, pod: Pod, version: int) -> None:
        """The pod's generator gets a full manifest of ``version`` from its trainer when it
        does not serve it (one ahead of the trainer rolls back), and so does one whose weights
        are unsettled (``weight_state`` needs_full or applying: a failed or overrun apply; it
        refuses Generate and every version-only manifest until a full one lands). The trainer
        is acknowledged in any case, so a version whose acknowledgement was lost (e.g. the
        controller died mid-sync) cannot block it. A generator asleep (a step that slept it
        for Train failed, or the controller restarted meanwhile) is woken first: it must
        generate next."""
        try:
            info = self._clients.generator(pod.generator).Info(
                common_pb2.InfoRequest(), timeout=self._clients.short
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "sync", f"generator {pod.generator} Info: {describe_rpc_error(err)}"
            ) from err
        if info.sleeping:
            log.info("generator of pod %s is asleep: waking it", pod.id)
            self.wake(pod)
        if info.policy_version > version:
            log.warning(
                "generator of pod %s is ahead of its trainer (version %d): rollback",
                pod.id,
                version,
            )
            self.sync(pod, version, rollback=True)  # a rollback sends a full manifest
        elif info.policy_version < version or info.weight_state in _UNSETTLED:
            log.info("generator of pod %s is behind version %d: full weight sync", pod.id, version)
            self.sync(pod, version, force_full=True)
        else:
            self._acknowledge(pod, self._clients.trainer(pod.trainer), version)

    # -- the step boundary -------------------------------------------------------------------------
    def align(self, table: PodTable, expected: int) -> list[Pod]:
        """A step boundary over the pod table: admit the pods, ask each trainer its version
        (one whose sync to ``expected`` succeeded since the last align, with the same processes,
        is not asked), tell the joining ones (their trainer is behind and heals from a peer
        inside its first Train; their generator is synced after it), and bring every other
        pod's generator to ``expected``. The pods that generate."""
        pods = table.admit()
        if not pods:
            raise StepFailedError("align", "no complete, healthy worker pod is registered")
        for before in table.replaced(pods):  # a process restarted: fresh channels
            for address in {before.trainer, before.generator, before.grader}:
                self._clients.forget(address)
        synced = table.take_synced()
        settled = {pod.id for pod in pods if synced.get(pod.id) == (pod, expected)}
        versions = self._trainer_versions(table, [pod for pod in pods if pod.id not in settled])
        versions |= dict.fromkeys(settled, expected)
        ready = table.settle_versions(versions, expected)
        # A generator that restarted, or missed a sync while it was unreachable, is brought
        # to the trainer's version first: its samples would be refused otherwise.
        unsettled = [pod for pod in ready if pod.id not in settled]
        outcomes = settle(
            self._pool, [lambda p=p: self.bring_generator_to(p, expected) for p in unsettled]
        )
        for pod, outcome in zip(unsettled, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, StepFailedError) or not table.lost(pod):
                    raise outcome
                table.drop(pod.id, f"align: {outcome}")
        return table.note_generating()

    def _trainer_versions(self, table: PodTable, pods: list[Pod]) -> dict[str, int]:
        """Each pod's trainer version (Info); a pod whose trainer does not answer leaves."""
        infos = settle(
            self._pool, [lambda p=p: trainer_info(self._clients, p.trainer) for p in pods]
        )
        versions = {}
        for pod, info in zip(pods, infos, strict=True):
            if isinstance(info, trainer_pb2.TrainerInfo):
                versions[pod.id] = info.policy_version
            else:
                table.mark_unreachable(pod.trainer)
                table.drop(pod.id, f"trainer {pod.trainer} does not answer Info")
        return versions
