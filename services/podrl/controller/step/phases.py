"""The generate and score phases of a step: RPC fan-outs over the step's pods, and the checks
that their replies are whole before anything is trained on them.

Each pod generates its share of the step's prompts on its own generator (a prompt's group never
spans pods) and scores those samples on its own grader. A pod that is lost meanwhile (a call
failed at the transport level, or it is draining or terminating) leaves the roster; what it
already returned is kept, and its unfinished share is done by the remaining pods in the same
phase. Any other failure, or no pod left, raises ``StepFailedError``: the loop then throws the
attempt away and retries the step with the same prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import grpc

from podrl.config.loop import SamplingConfig
from podrl.controller.pods.clients import WorkerClients
from podrl.controller.pods.membership import MemberRegistry
from podrl.controller.pods.roster import Pod, PodRoster
from podrl.controller.step.batch import StepSamples, sample_id
from podrl.controller.step_errors import TRANSPORT_FAILURES, StepFailedError, describe_rpc_error
from podrl.grader.requests import build_score_item
from podrl.tasks import PromptItem
from podrl.v1 import common_pb2, generator_pb2, grader_pb2

T = TypeVar("T")
W = TypeVar("W")

#: A call that failed with one of these lost its pod: unreachable, or the server went away
#: under the call (CANCELLED: the controller cancels none of its own calls).
POD_LOST = (*TRANSPORT_FAILURES, grpc.StatusCode.CANCELLED)


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
        registry: MemberRegistry,
        roster: PodRoster,
    ) -> None:
        self.clients = clients
        self.pool = pool
        self.registry = registry
        self.roster = roster

    def on_rpc_failure(self, address: str, err: grpc.RpcError) -> None:
        """A worker that cannot be reached is taken out until it heartbeats again."""
        if err.code() in POD_LOST:
            self.registry.mark_unreachable(address)

    def _pod_error(self, pod: Pod, what: str, address: str, err: grpc.RpcError) -> PodCallError:
        self.on_rpc_failure(address, err)
        lost = err.code() in POD_LOST or not self.roster.usable(pod)
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
                self.roster.drop(pod.id, f"{phase}: {outcome}")
                live.remove(pod)
                pending.extend(work)
            if not pending:
                return
            live = [pod for pod in live if self.roster.usable(pod)]
            if not live:
                assert first_error is not None
                raise StepFailedError(phase, f"{first_error}; no pod left to take its share")
            chunks = split_round_robin(pending, len(live))
            assigned = list(zip(live, chunks, strict=False))

    def _check_pods(self, pods: list[Pod]) -> list[Pod]:
        """The pods still usable; the others leave the roster now (drained, terminating)."""
        kept = []
        for pod in pods:
            if self.roster.usable(pod):
                kept.append(pod)
            else:
                self.roster.drop(pod.id, "draining, terminating or no longer healthy")
        return kept

    # -- generate ----------------------------------------------------------------------------
    def generate(
        self,
        step: int,
        data: StepSamples,
        sampling: SamplingConfig,
        seed: int | None,
        policy_version: int | None,
        pods: list[Pod],
    ) -> None:
        """``sampling.n`` samples of every prompt into ``data.samples``, each prompt on one of
        ``pods`` (recorded in ``data.pod_of``); every one must come back, sampled by
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
        if seed is not None:
            params.seed = seed

        def call(pod: Pod, chunk: list[PromptItem]) -> None:
            request = generator_pb2.GenerateRequest(
                prompts=[
                    common_pb2.Prompt(
                        id=item.id,
                        text=item.prompt,
                        task=item.task,
                        reference=item.reference,
                        metadata=item.metadata,
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
        self.roster.note_shares(prompts=data.prompts_by_pod())
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
                build_score_item(item, sample.text, sample_id(item.id, sample.index))
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
