"""The worker pods that train the policy, and the epoch: one owner for both, and for every pod
fact that outlives a step (joining, the trainer incarnation that trained, the last sync).

A *pod* is one worker id (the StatefulSet pod's name in a cluster, ``local-N`` locally) whose
generator, grader and trainer are all registered and healthy (``membership.py`` groups them).
Every pod's trainer holds a full replica of the policy; its generator serves that replica's
weights, synced inside the pod.

The roster decides which pods take part in a step:

- :meth:`PodRoster.admit`, at each step boundary: every complete, healthy pod that is not
  draining and not terminating (in a cluster the Kubernetes watch sees a pod's deletion
  timestamp before its services drain). So a pod that registers mid-step joins at the next
  step, never in the middle of one.
- :meth:`PodRoster.drop`, mid-step: a pod that was lost (a call failed at the transport level,
  or its trainer restarted) or drained leaves at once; the rest of the step is done without it.

The *epoch* counts the changes of that set: it goes up by one each time the roster differs from
the one before (a pod admitted or dropped, or one of a pod's processes restarted under the same
worker id). Each step record names the epoch it was trained in and the pods that trained it.

Outside a cluster the same decisions run on membership alone; in a cluster ``terminating``
comes from :class:`podrl.controller.pods.kube_watch.ClusterView`.
"""

from __future__ import annotations

import enum
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from podrl.controller import loop_metrics as metrics
from podrl.controller.pods.membership import MemberRegistry
from podrl.v1 import controller_pb2

log = logging.getLogger(__name__)

_ORDINAL = re.compile(r"-(\d+)$")


def pod_ordinal(pod_id: str) -> int | None:
    """N of a StatefulSet-style name ``<name>-N`` (``local-N`` locally); None otherwise."""
    match = _ORDINAL.search(pod_id)
    return int(match.group(1)) if match else None


def pod_order(pod_id: str) -> tuple[int, int, str]:
    """Pods by ordinal, then name (names without an ordinal last)."""
    ordinal = pod_ordinal(pod_id)
    return (0, ordinal, pod_id) if ordinal is not None else (1, 0, pod_id)


@dataclass(frozen=True)
class Pod:
    """One admitted worker pod: where its three services are, and which processes they are."""

    id: str
    trainer: str
    generator: str
    grader: str
    incarnations: tuple[str, str, str] = ("", "", "")
    """Of its trainer, generator and grader: a restarted process is a changed pod."""


class PodPhase(enum.StrEnum):
    """Where a pod is in its life: waiting → joining → training → draining → gone."""

    WAITING = "waiting"
    """Complete and healthy; admitted at the next step boundary."""
    JOINING = "joining"
    """Admitted; its trainer is behind and heals from a peer in its first Train."""
    TRAINING = "training"
    """In the current step's roster, at the run's version."""
    DRAINING = "draining"
    """Its services drain, or the cluster is deleting it."""
    GONE = "gone"
    """Dropped mid-step and not back."""
    INCOMPLETE = "incomplete"
    """A service missing or unhealthy (a pod starting, or one that lost a process)."""


@dataclass(frozen=True)
class PodStatus:
    """A pod as ``/v1/status`` shows it."""

    id: str
    state: PodPhase
    policy_version: int | None
    """Its trainer's version (as last reported); None when it has no trainer."""
    share: int
    """Prompts of the current step generated and scored on this pod."""
    train_sequences: int
    """Sequences of the current step's batch sent to its trainer."""


@dataclass
class _StepShares:
    prompts: dict[str, int] = field(default_factory=dict)
    sequences: dict[str, int] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)
    joining: set[str] = field(default_factory=set)


class PodRoster:
    """Owns the admitted pods and the epoch; thread-safe (the loop writes, status pages read)."""

    def __init__(
        self,
        registry: MemberRegistry,
        desired_replicas: Callable[[], int | None] = lambda: None,
        terminating: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        self.registry = registry
        self._desired = desired_replicas
        self._terminating = terminating
        self._lock = threading.Lock()
        self._pods: list[Pod] = []
        self._dropped: set[str] = set()
        self._epoch = 0
        self._shares = _StepShares()
        self._trained_with: dict[str, str] = {}
        """Pod id → the incarnation of its trainer process last sent a Train (a torchft
        replica heartbeating to the Lighthouse)."""
        self._seen: dict[str, Pod] = {}
        """Each pod as last admitted."""
        self._synced: dict[str, tuple[Pod, int]] = {}
        """Pod id → (the pod, the version) of each sync that succeeded since the last
        :meth:`take_synced`: its trainer published that version and its generator applied it."""
        metrics.DESIRED_REPLICAS.set_function(lambda: self.desired_replicas() or 0)

    # -- reading ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        with self._lock:
            return self._epoch

    def pods(self) -> list[Pod]:
        with self._lock:
            return list(self._pods)

    def desired_replicas(self) -> int | None:
        """The number of worker pods asked for (the StatefulSet's, or the local launcher's)."""
        try:
            return self._desired()
        except Exception as err:  # a status page must not fail because the API server did
            log.warning("desired replicas unknown: %s", err)
            return None

    def _candidates(self) -> list[Pod]:
        terminating = self._terminating()
        pods = []
        for pod_id, parts in self.registry.complete_pods().items():
            if pod_id in terminating:
                continue
            trainer = parts[controller_pb2.COMPONENT_TRAINER]
            generator = parts[controller_pb2.COMPONENT_GENERATOR]
            grader = parts[controller_pb2.COMPONENT_GRADER]
            pods.append(
                Pod(
                    pod_id,
                    trainer.address,
                    generator.address,
                    grader.address,
                    (trainer.incarnation, generator.incarnation, grader.incarnation),
                )
            )
        return sorted(pods, key=lambda pod: pod_order(pod.id))

    def candidates(self) -> list[Pod]:
        """The pods :meth:`admit` would admit now (complete, healthy, not draining or
        terminating), by ordinal; the roster is left as it is."""
        return self._candidates()

    def joining(self) -> frozenset[str]:
        """The admitted pods whose trainer is behind the run's version (as of the step's
        align): they heal from a peer in this step's Train, their generators are synced after
        it. The one place this is kept: set by :meth:`note_versions`, cleared by
        :meth:`note_trained`."""
        with self._lock:
            return frozenset(self._shares.joining)

    def terminating(self) -> frozenset[str]:
        """Pods the cluster is deleting (none outside a cluster)."""
        return self._terminating()

    def usable(self, pod: Pod) -> bool:
        """The pod is still as admitted: its three processes healthy (same incarnations) and
        not terminating. Checked between the phases of a step."""
        return pod in self._candidates()

    # -- changing --------------------------------------------------------------------------------
    def admit(self) -> list[Pod]:
        """At a step boundary: the step's pods (complete, healthy, not draining or
        terminating), by ordinal. A set that differs from the last one starts a new epoch."""
        pods = self._candidates()
        with self._lock:
            if pods != self._pods:
                self._new_epoch(pods, "admitted")
            self._dropped -= {pod.id for pod in pods}
            self._shares = _StepShares()
            return list(self._pods)

    def drop(self, pod_id: str, reason: str) -> None:
        """Mid-step: ``pod_id`` is lost or drained; the rest of the step is done without it."""
        with self._lock:
            kept = [pod for pod in self._pods if pod.id != pod_id]
            if kept == self._pods:
                return
            log.warning("pod %s leaves the roster: %s", pod_id, reason)
            self._dropped.add(pod_id)
            self._new_epoch(kept, "dropped")

    def _new_epoch(self, pods: list[Pod], why: str) -> None:
        before = [pod.id for pod in self._pods]
        self._pods = pods
        self._epoch += 1
        log.info(
            "epoch %d (%s): pods %s (before: %s)",
            self._epoch,
            why,
            [pod.id for pod in pods] or "none",
            before or "none",
        )
        metrics.EPOCH.set(self._epoch)
        metrics.PODS.set(len(pods))

    def note_versions(self, versions: dict[str, int], expected: int) -> None:
        """The trainers' versions at the step's start: those behind ``expected`` are joining."""
        with self._lock:
            self._shares.versions.update(versions)
            self._shares.joining = {pod for pod, v in versions.items() if v < expected}

    def note_shares(
        self, prompts: dict[str, int] | None = None, sequences: dict[str, int] | None = None
    ) -> None:
        """What each pod got of the current step (generation and scoring; training)."""
        with self._lock:
            if prompts is not None:
                self._shares.prompts = dict(prompts)
            if sequences is not None:
                self._shares.sequences = dict(sequences)

    def note_trained(self, versions: dict[str, int]) -> None:
        """The trainers that applied the step, at their new version: no longer joining."""
        with self._lock:
            self._shares.versions.update(versions)
            self._shares.joining -= set(versions)

    def replaced(self, pods: list[Pod]) -> list[Pod]:
        """Of ``pods`` (just admitted), each pod as admitted before whose processes changed
        since (their channels are stale); ``pods`` are remembered as admitted now."""
        with self._lock:
            before = [self._seen.get(pod.id) for pod in pods]
            self._seen.update((pod.id, pod) for pod in pods)
        return [old for old, pod in zip(before, pods, strict=True) if old not in (None, pod)]

    def note_synced(self, pod: Pod, version: int) -> None:
        """``pod``'s trainer published ``version`` and its generator applied it."""
        with self._lock:
            self._synced[pod.id] = (pod, version)

    def take_synced(self) -> dict[str, tuple[Pod, int]]:
        """The syncs that succeeded since the last call (one align reads them: a retry's
        align asks every pod again)."""
        with self._lock:
            synced, self._synced = self._synced, {}
            return synced

    def trained_with(self) -> dict[str, str]:
        """Pod id → the incarnation of its trainer process last sent a Train."""
        with self._lock:
            return dict(self._trained_with)

    def note_train_set(self, incarnations: dict[str, str]) -> None:
        """A Train goes to these trainers (pod id → its process's incarnation)."""
        with self._lock:
            self._trained_with.update(incarnations)

    # -- status ----------------------------------------------------------------------------------
    def status(self) -> list[PodStatus]:
        """Every pod the controller knows of: admitted ones first, by ordinal."""
        members = self.registry.pod_members()
        terminating = self._terminating()
        with self._lock:
            admitted = {pod.id for pod in self._pods}
            shares = self._shares
            dropped = set(self._dropped)
        rows = []
        for pod_id in sorted(set(members) | admitted | dropped, key=pod_order):
            views = members.get(pod_id, [])
            trainer = next((v for v in views if v.component == "trainer"), None)
            version = shares.versions.get(pod_id)
            if version is None and trainer is not None:
                version = trainer.policy_version
            if pod_id in terminating or any(v.state == "draining" for v in views):
                state = PodPhase.DRAINING
            elif pod_id in admitted:
                state = PodPhase.JOINING if pod_id in shares.joining else PodPhase.TRAINING
            elif len(views) == 3 and all(v.healthy for v in views):
                state = PodPhase.WAITING
            elif pod_id in dropped and not any(v.healthy for v in views):
                state = PodPhase.GONE
            else:
                state = PodPhase.INCOMPLETE
            rows.append(
                PodStatus(
                    id=pod_id,
                    state=state,
                    policy_version=version,
                    share=shares.prompts.get(pod_id, 0) if pod_id in admitted else 0,
                    train_sequences=shares.sequences.get(pod_id, 0) if pod_id in admitted else 0,
                )
            )
        return rows
