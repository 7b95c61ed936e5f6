"""A step boundary: which pods take part in the next step, and at which policy version.

The loop asks :class:`StepBoundary` three things (docs/controller.md, "One step"):

- :meth:`~StepBoundary.align` at the start of a step: admit the roster's pods, tell the joining
  ones apart (their trainer is behind and heals from a peer inside its first Train; their
  generator is synced after it) and bring every other pod's generator to the run's version.
  It returns the pods that generate.
- :meth:`~StepBoundary.train_set` before Train: every trainer that must get this step's Train
  (torchft's quorum counts each trainer that has trained in this run).
- :meth:`~StepBoundary.lead`: the pod whose trainer writes checkpoints and exports.

The boundary is functions over the roster (pods/roster.py), which keeps every pod fact that
outlives a step: which pods are joining, the trainer incarnation each pod last trained with,
each pod as last admitted, the syncs that succeeded since the last align. Only the pods that
generate, as of the last align, are kept here.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from podrl.controller.pods.roster import Pod, PodRoster, pod_order
from podrl.controller.service.status import RunState
from podrl.controller.step.pod_calls import WeightSync, WorkerClients, settle, trainer_info
from podrl.controller.step_errors import RunFailedError, StepFailedError
from podrl.v1 import controller_pb2, trainer_pb2

log = logging.getLogger(__name__)


class StepBoundary:
    def __init__(
        self,
        state: RunState,
        roster: PodRoster,
        clients: WorkerClients,
        pool: ThreadPoolExecutor,
        weights: WeightSync,
    ) -> None:
        self.state = state
        self.roster = roster
        self.clients = clients
        self._pool = pool
        self.weights = weights
        self.generating: list[Pod] = []
        """The pods whose generators generate, as of the last align (async mode's producer
        reads it)."""

    # -- what the loop reads ---------------------------------------------------------------------
    def lead(self) -> Pod:
        """The pod whose trainer writes checkpoints and answers for the run at resume: the
        first (by ordinal) that is not still joining."""
        pods = self.roster.pods() or self.roster.candidates()  # asking admits no pod
        joining = self.roster.joining()
        ready = [pod for pod in pods if pod.id not in joining]
        if not ready:
            raise StepFailedError("train", "no healthy trainer is registered")
        return ready[0]

    def lost(self, pod: Pod) -> bool:
        return not self.roster.usable(pod)

    def trainer_lost(self, pod_id: str, reason: str) -> None:
        """A pod whose trainer stopped answering mid-step leaves; it comes back (and heals)
        when its trainer heartbeats or registers again."""
        for pod in self.roster.pods():
            if pod.id == pod_id:
                self.state.registry.mark_unreachable(pod.trainer)
        self.roster.drop(pod_id, reason)

    def train_set(self) -> dict[str, str]:
        """Pod id → trainer address of every trainer this step's Train goes to: each healthy
        trainer of the roster's pods, and every other healthy trainer process that has trained
        in this run (a pod that lost its generator or grader mid-step, say). torchft's
        Lighthouse counts the trainers that heartbeat to it (from their first Train on), and
        one that is not sent a step holds the others' quorum until its timeout
        (docs/scaling.md, "Trainers across pods"); an empty share is fine. A trainer that is
        draining or gone is left out (its pod leaves the roster)."""
        healthy = self.state.registry.healthy_members(controller_pb2.COMPONENT_TRAINER)
        terminating = self.roster.terminating()
        trainers: dict[str, str] = {}
        for pod in self.roster.pods():
            member = healthy.get(pod.id)
            if member is None or member.incarnation != pod.incarnations[0] or pod.id in terminating:
                self.roster.drop(pod.id, "its trainer is draining, terminating or gone")
            else:
                trainers[pod.id] = pod.trainer
        trained_with = self.roster.trained_with()
        for pod_id, member in healthy.items():
            if trained_with.get(pod_id) == member.incarnation and pod_id not in terminating:
                trainers.setdefault(pod_id, member.address)
        self.roster.note_train_set({pod_id: healthy[pod_id].incarnation for pod_id in trainers})
        return {pod_id: trainers[pod_id] for pod_id in sorted(trainers, key=pod_order)}

    # -- the boundary itself ---------------------------------------------------------------------
    def _trainer_versions(self, pods: list[Pod]) -> dict[str, int]:
        """Each pod's trainer version (Info); a pod whose trainer does not answer leaves."""
        infos = settle(
            self._pool, [lambda p=p: trainer_info(self.clients, p.trainer) for p in pods]
        )
        versions = {}
        for pod, info in zip(pods, infos, strict=True):
            if isinstance(info, trainer_pb2.TrainerInfo):
                versions[pod.id] = info.policy_version
            else:
                self.state.registry.mark_unreachable(pod.trainer)
                self.roster.drop(pod.id, f"trainer {pod.trainer} does not answer Info")
        return versions

    def align(self, expected: int) -> list[Pod]:
        """A step boundary: admit the pods, tell the joining ones (their trainer is behind and
        heals from a peer inside its first Train; their generator is synced after it), and
        bring every other pod's generator to ``expected``. The pods that generate."""
        pods = self.roster.admit()
        if not pods:
            raise StepFailedError("align", "no complete, healthy worker pod is registered")
        for before in self.roster.replaced(pods):  # a process restarted: fresh channels
            for address in {before.trainer, before.generator, before.grader}:
                self.clients.forget(address)
        synced = self.roster.take_synced()
        settled = {pod.id for pod in pods if synced.get(pod.id) == (pod, expected)}
        versions = self._trainer_versions([pod for pod in pods if pod.id not in settled])
        versions |= dict.fromkeys(settled, expected)
        ahead = {pod: v for pod, v in versions.items() if v > expected}
        if ahead:
            raise RunFailedError(
                f"the trainers of pods {sorted(ahead)} are at policy versions "
                f"{sorted(set(ahead.values()))}, ahead of the run's {expected}; restart the run "
                "to resume from its records and checkpoints"
            )
        self.roster.note_versions(versions, expected)
        joining = self.roster.joining()
        ready = [pod for pod in self.roster.pods() if pod.id not in joining]
        if not ready and versions:
            pod, version = next(iter(versions.items()))
            raise RunFailedError(
                f"the trainer of pod {pod} is at policy version {version} (expected {expected})"
                f" and no trainer holds version {expected} to heal it from; restart the run to "
                "resume from its records and checkpoints"
            )
        if joining:
            log.info(
                "pods %s join at version %d: their trainers heal from a peer in this step's Train",
                sorted(joining),
                expected,
            )
        # A generator that restarted, or missed a sync while it was unreachable, is brought
        # to the trainer's version first: its samples would be refused otherwise.
        unsettled = [pod for pod in ready if pod.id not in settled]
        outcomes = settle(
            self._pool,
            [lambda p=p: self.weights.bring_generator_to(p, expected) for p in unsettled],
        )
        for pod, outcome in zip(unsettled, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, StepFailedError) or not self.lost(pod):
                    raise outcome
                self.roster.drop(pod.id, f"align: {outcome}")
        self.generating = [pod for pod in self.roster.pods() if pod.id not in joining]
        return self.generating
