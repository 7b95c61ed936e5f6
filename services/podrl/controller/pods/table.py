"""The pod table: one thread-safe owner of everything the controller knows about its worker
pods, and the epoch.

A *pod* is one worker id (the StatefulSet pod's name in a cluster, ``local-N`` locally) whose
generator, grader and trainer are all registered and healthy. Every pod's trainer holds a full
replica of the policy; its generator serves that replica's weights, synced inside the pod. The
table keeps, per pod: its processes (addresses, incarnations, state, last heartbeat, the version
each reports), its phase (:class:`PodPhase`), its trainer's version as of the step's align, the
incarnation of the trainer last sent a Train, its last successful sync, its shares of the
current step; and the run's epoch. Membership feeds it (``Register``, ``Heartbeat``, ``Drain``,
a transport failure of a call the loop makes), and so does the Kubernetes view (the desired
count and the pods being deleted: :meth:`PodTable.follow_cluster`); the step boundary is
functions over it (below); status, metrics and the dashboard read it.

**Membership.** The table is bounded: worker ids, addresses and incarnations are validated and
bounded in length, at most ``max_members`` processes are registered at once, and a member not
heard from for ``expire_after_seconds`` is removed. A (worker id, component) that a live process
holds is not taken over by a process at another address until the holder drains, is marked
unreachable or stops heartbeating.

**The step boundary.** Which pods take part in a step (docs/controller.md, "One step"):

- :meth:`PodTable.admit`, at each step boundary: every complete, healthy pod that is not
  draining and not terminating (in a cluster the Kubernetes watch sees a pod's deletion
  timestamp before its services drain). So a pod that registers mid-step joins at the next
  step, never in the middle of one. :meth:`PodTable.settle_versions` then tells the joining
  pods (their trainer is behind and heals from a peer inside its first Train; their generator
  is synced after it) from the ones that generate (``step/pod_calls.py``'s ``WeightSync.align``
  asks the versions and brings those generators to the run's version);
- :meth:`PodTable.drop`, mid-step: a pod that was lost (a call failed at the transport level,
  or its trainer restarted) or drained leaves at once; the rest of the step is done without it;
- :meth:`PodTable.train_set`, before Train: every trainer that must get this step's Train
  (torchft's quorum counts each trainer that has trained in this run);
- :meth:`PodTable.lead`: the pod whose trainer writes checkpoints and exports (asking admits
  none).

The *epoch* counts the changes of the admitted set: it goes up by one each time the set differs
from the one before (a pod admitted or dropped, or one of a pod's processes restarted under the
same worker id). Each step record names the epoch it was trained in and the pods that trained
it. Outside a cluster the same decisions run on membership alone.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from podrl.common.auth import worker_id_problem
from podrl.controller import loop_metrics as metrics
from podrl.controller.step_errors import RunFailedError, StepFailedError
from podrl.v1 import controller_pb2

log = logging.getLogger(__name__)

COMPONENT_NAMES = {
    controller_pb2.COMPONENT_GENERATOR: "generator",
    controller_pb2.COMPONENT_GRADER: "grader",
    controller_pb2.COMPONENT_TRAINER: "trainer",
}
STATE_NAMES = {
    controller_pb2.WORKER_STATE_STARTING: "starting",
    controller_pb2.WORKER_STATE_SERVING: "serving",
    controller_pb2.WORKER_STATE_DRAINING: "draining",
    controller_pb2.WORKER_STATE_GONE: "gone",
}
#: A worker pod is usable once it runs one of each.
POD_COMPONENTS = frozenset(COMPONENT_NAMES)

#: Registered processes at most (three per worker pod).
MAX_MEMBERS = 3 * 1024
#: An incarnation is a random id per process start (podrl sends 32 hex digits).
MAX_INCARNATION_CHARS = 128
_INCARNATION = re.compile(r"[!-~]+")  # printable ASCII, no spaces
_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


class RegistrationError(ValueError):
    """A request the registry refuses; ``field`` names the request field at fault."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


class WorkerIdTakenError(RegistrationError):
    """The (worker id, component) belongs to a live process at another address."""


class RegistryFullError(RegistrationError):
    """``max_members`` processes are registered and none has expired."""


def address_problem(address: str) -> str | None:
    """Why ``address`` is not ``host:port`` a worker can be dialled at, or None."""
    if len(address) > 261:  # 253 for the host name, brackets, a colon, 5 digits
        return f"is {len(address)} characters long; a host:port has at most 261"
    host, sep, port = address.rpartition(":")
    if not sep or not host:
        return f"must be host:port (got {address!r})"
    if not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        return f"port must be a number from 1 to 65535 (got {port!r} in {address!r})"
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"host {host!r} is not an IPv6 address"
        return None
    labels = host.split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        return f"host {host!r} is neither a host name nor an IP address ([v6] in brackets)"
    return None


def incarnation_problem(incarnation: str) -> str | None:
    if not incarnation:
        return "must not be empty (a random id of the process start)"
    if len(incarnation) > MAX_INCARNATION_CHARS or not _INCARNATION.fullmatch(incarnation):
        return f"must be 1 to {MAX_INCARNATION_CHARS} printable ASCII characters"
    return None


@dataclass
class Member:
    """One registered service process."""

    worker_id: str
    component: int
    address: str
    incarnation: str
    state: int
    last_seen: float
    policy_version: int = 0

    @property
    def component_name(self) -> str:
        return COMPONENT_NAMES.get(self.component, "unknown")

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, "unknown")


@dataclass(frozen=True)
class MemberView:
    """A member as status pages show it."""

    worker_id: str
    component: str
    address: str
    state: str
    healthy: bool
    seconds_since_heartbeat: float
    policy_version: int


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


class PodTable:
    """Every pod fact and the epoch, behind one lock; the loop and membership write it, status
    pages read it. ``expire_after_seconds`` defaults to six heartbeat timeouts, at least a
    minute."""

    def __init__(
        self,
        heartbeat_timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
        max_members: int = MAX_MEMBERS,
        expire_after_seconds: float | None = None,
    ) -> None:
        self._timeout = heartbeat_timeout_seconds
        self._clock = clock
        self._max_members = max_members
        self._expire_after = (
            expire_after_seconds
            if expire_after_seconds is not None
            else max(60.0, 6 * heartbeat_timeout_seconds)
        )
        self._desired: Callable[[], int | None] = lambda: None
        self._terminating: Callable[[], frozenset[str]] = frozenset
        self._lock = threading.Lock()
        self._members: dict[tuple[str, int], Member] = {}
        self._pods: list[Pod] = []
        """The admitted pods, by ordinal."""
        self._dropped: set[str] = set()
        self._epoch = 0
        self._shares = _StepShares()
        self._generating: list[Pod] = []
        """The pods whose generators generate, as of the last align."""
        self._trained_with: dict[str, str] = {}
        """Pod id → the incarnation of its trainer process last sent a Train (a torchft
        replica heartbeating to the Lighthouse)."""
        self._seen: dict[str, Pod] = {}
        """Each pod as last admitted."""
        self._synced: dict[str, tuple[Pod, int]] = {}
        """Pod id → (the pod, the version) of each sync that succeeded since the last
        :meth:`take_synced`: its trainer published that version and its generator applied it."""
        metrics.DESIRED_REPLICAS.set_function(lambda: self.desired_replicas() or 0)

    def follow_cluster(
        self,
        desired_replicas: Callable[[], int | None],
        terminating: Callable[[], frozenset[str]] = frozenset,
    ) -> None:
        """Where the desired pod count (the StatefulSet's, or the local launcher's) and the pods
        the cluster is deleting are read (``service/main.py``'s ``build_scaling``)."""
        self._desired = desired_replicas
        self._terminating = terminating

    # -- membership ------------------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        """Forget members not heard from for ``expire_after_seconds`` (lock held)."""
        gone = [k for k, m in self._members.items() if now - m.last_seen > self._expire_after]
        for key in gone:
            del self._members[key]

    def register(self, worker_id: str, component: int, address: str, incarnation: str) -> None:
        """Add or replace the member; raises RegistrationError (a bad field), WorkerIdTakenError
        or RegistryFullError, leaving the table as it was."""
        if component not in COMPONENT_NAMES:
            raise RegistrationError(
                "component", f"must be GENERATOR, GRADER or TRAINER ({component})"
            )
        for field_name, problem in (
            ("worker_id", worker_id_problem(worker_id)),
            ("address", address_problem(address)),
            ("incarnation", incarnation_problem(incarnation)),
        ):
            if problem:
                raise RegistrationError(field_name, problem)
        now = self._clock()
        with self._lock:
            self._expire(now)
            key = (worker_id, component)
            held = self._members.get(key)
            if (
                held is not None
                and held.incarnation != incarnation
                and held.address != address
                and held.state
                in (controller_pb2.WORKER_STATE_SERVING, controller_pb2.WORKER_STATE_STARTING)
                and now - held.last_seen <= self._timeout
            ):
                raise WorkerIdTakenError(
                    "worker_id",
                    f"{worker_id!r}: its {COMPONENT_NAMES[component]} is registered at "
                    f"{held.address} and still heartbeating; a process at {address} may take "
                    "its place once it drains or its heartbeats stop for "
                    f"controller.heartbeat_timeout_seconds ({self._timeout:g} s)",
                )
            if held is None and len(self._members) >= self._max_members:
                raise RegistryFullError(
                    "worker_id",
                    f"{worker_id!r} cannot be registered: {len(self._members)} processes are "
                    f"registered, the most the controller keeps ({self._max_members})",
                )
            self._members[key] = Member(
                worker_id=worker_id,
                component=component,
                address=address,
                incarnation=incarnation,
                state=controller_pb2.WORKER_STATE_SERVING,
                last_seen=now,
            )

    def heartbeat(
        self, worker_id: str, component: int, incarnation: str, state: int, policy_version: int
    ) -> bool:
        """Record a heartbeat; False when the process is unknown (it must register again)."""
        with self._lock:
            member = self._members.get((worker_id, component))
            if member is None or member.incarnation != incarnation:
                return False
            member.last_seen = self._clock()
            member.state = state or member.state
            member.policy_version = policy_version
            return True

    def drain(self, worker_id: str, component: int, incarnation: str) -> bool:
        """Mark that incarnation draining; False when it is not the registered one (an empty
        incarnation matches none: a drain must name the process it ends)."""
        with self._lock:
            member = self._members.get((worker_id, component))
            if member is None or not incarnation or member.incarnation != incarnation:
                return False
            member.state = controller_pb2.WORKER_STATE_DRAINING
            return True

    def mark_unreachable(self, address: str) -> None:
        """A call to ``address`` failed at the transport level: treat the member as gone until
        it heartbeats or registers again (faster than waiting for the heartbeat timeout)."""
        with self._lock:
            for member in self._members.values():
                if member.address == address:
                    member.state = controller_pb2.WORKER_STATE_GONE

    def _healthy(self, member: Member, now: float) -> bool:
        return (
            member.state == controller_pb2.WORKER_STATE_SERVING
            and now - member.last_seen <= self._timeout
        )

    def members(self) -> list[MemberView]:
        now = self._clock()
        with self._lock:
            self._expire(now)
            return [
                MemberView(
                    worker_id=m.worker_id,
                    component=m.component_name,
                    address=m.address,
                    state=m.state_name,
                    healthy=self._healthy(m, now),
                    seconds_since_heartbeat=round(now - m.last_seen, 3),
                    policy_version=m.policy_version,
                )
                for m in sorted(self._members.values(), key=lambda m: (m.worker_id, m.component))
            ]

    def healthy_pods(self) -> list[str]:
        """Worker pods whose generator, grader and trainer are all healthy."""
        now = self._clock()
        with self._lock:
            by_pod: dict[str, set[int]] = {}
            for member in self._members.values():
                if self._healthy(member, now):
                    by_pod.setdefault(member.worker_id, set()).add(member.component)
        return sorted(pod for pod, parts in by_pod.items() if parts >= POD_COMPONENTS)

    def complete_pods(self) -> dict[str, dict[int, Member]]:
        """Worker pods whose generator, grader and trainer are all healthy: worker id →
        component → a copy of its member (address, incarnation, policy version)."""
        now = self._clock()
        with self._lock:
            by_pod: dict[str, dict[int, Member]] = {}
            for member in self._members.values():
                if self._healthy(member, now):
                    by_pod.setdefault(member.worker_id, {})[member.component] = dataclasses.replace(
                        member
                    )
        return {pod: parts for pod, parts in by_pod.items() if set(parts) >= POD_COMPONENTS}

    def pod_members(self) -> dict[str, list[MemberView]]:
        """Every registered process by worker pod (for status pages)."""
        by_pod: dict[str, list[MemberView]] = {}
        for view in self.members():
            by_pod.setdefault(view.worker_id, []).append(view)
        return by_pod

    def healthy_members(self, component: int) -> dict[str, Member]:
        """Worker id → a copy of every healthy process of ``component``."""
        now = self._clock()
        with self._lock:
            return {
                m.worker_id: dataclasses.replace(m)
                for m in self._members.values()
                if m.component == component and self._healthy(m, now)
            }

    # -- the admitted pods -----------------------------------------------------------------------
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

    def candidates(self) -> list[Pod]:
        """The pods :meth:`admit` would admit now (complete, healthy, not draining or
        terminating), by ordinal; the table is left as it is."""
        terminating = self._terminating()
        pods = []
        for pod_id, parts in self.complete_pods().items():
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

    def joining(self) -> frozenset[str]:
        """The admitted pods whose trainer is behind the run's version (as of the step's
        align): they heal from a peer in this step's Train, their generators are synced after
        it. Set by :meth:`settle_versions`, cleared by :meth:`note_trained`."""
        with self._lock:
            return frozenset(self._shares.joining)

    def generating(self) -> list[Pod]:
        """The pods whose generators generate, as of the last align (async mode's producer
        reads it)."""
        with self._lock:
            return list(self._generating)

    def terminating(self) -> frozenset[str]:
        """Pods the cluster is deleting (none outside a cluster)."""
        return self._terminating()

    def usable(self, pod: Pod) -> bool:
        """The pod is still as admitted: its three processes healthy (same incarnations) and
        not terminating. Checked between the phases of a step."""
        return pod in self.candidates()

    def lost(self, pod: Pod) -> bool:
        return not self.usable(pod)

    def lead(self) -> Pod:
        """The pod whose trainer writes checkpoints and answers for the run at resume: the
        first (by ordinal) that is not still joining. Asking admits no pod."""
        pods = self.pods() or self.candidates()
        joining = self.joining()
        ready = [pod for pod in pods if pod.id not in joining]
        if not ready:
            raise StepFailedError("train", "no healthy trainer is registered")
        return ready[0]

    # -- the step boundary -----------------------------------------------------------------------
    def admit(self) -> list[Pod]:
        """At a step boundary: the step's pods (complete, healthy, not draining or
        terminating), by ordinal. A set that differs from the last one starts a new epoch."""
        pods = self.candidates()
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

    def trainer_lost(self, pod_id: str, reason: str) -> None:
        """A pod whose trainer stopped answering mid-step leaves; it comes back (and heals)
        when its trainer heartbeats or registers again."""
        for pod in self.pods():
            if pod.id == pod_id:
                self.mark_unreachable(pod.trainer)
        self.drop(pod_id, reason)

    def settle_versions(self, versions: dict[str, int], expected: int) -> list[Pod]:
        """The align's verdict on the trainers' ``versions`` at the step's start (pod id →
        version): a trainer ahead of the run's ``expected`` version, or no trainer at it to heal
        the others from, fails the run; those behind are joining. The admitted pods that are
        not."""
        ahead = {pod: v for pod, v in versions.items() if v > expected}
        if ahead:
            raise RunFailedError(
                f"the trainers of pods {sorted(ahead)} are at policy versions "
                f"{sorted(set(ahead.values()))}, ahead of the run's {expected}; restart the run "
                "to resume from its records and checkpoints"
            )
        with self._lock:
            self._shares.versions.update(versions)
            joining = self._shares.joining = {pod for pod, v in versions.items() if v < expected}
            ready = [pod for pod in self._pods if pod.id not in joining]
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
        return ready

    def note_generating(self) -> list[Pod]:
        """The align is done: the admitted pods that are not joining generate."""
        with self._lock:
            self._generating = [p for p in self._pods if p.id not in self._shares.joining]
            return list(self._generating)

    def train_set(self) -> dict[str, str]:
        """Pod id → trainer address of every trainer this step's Train goes to: each healthy
        trainer of the admitted pods, and every other healthy trainer process that has trained
        in this run (a pod that lost its generator or grader mid-step, say). torchft's
        Lighthouse counts the trainers that heartbeat to it (from their first Train on), and
        one that is not sent a step holds the others' quorum until its timeout
        (docs/scaling.md, "Trainers across pods"); an empty share is fine. A trainer that is
        draining or gone is left out (its pod leaves the admitted set)."""
        healthy = self.healthy_members(controller_pb2.COMPONENT_TRAINER)
        terminating = self.terminating()
        trainers: dict[str, str] = {}
        for pod in self.pods():
            member = healthy.get(pod.id)
            if member is None or member.incarnation != pod.incarnations[0] or pod.id in terminating:
                self.drop(pod.id, "its trainer is draining, terminating or gone")
            else:
                trainers[pod.id] = pod.trainer
        with self._lock:
            trained_with = dict(self._trained_with)
        for pod_id, member in healthy.items():
            if trained_with.get(pod_id) == member.incarnation and pod_id not in terminating:
                trainers.setdefault(pod_id, member.address)
        with self._lock:
            self._trained_with.update({pod_id: healthy[pod_id].incarnation for pod_id in trainers})
        return {pod_id: trainers[pod_id] for pod_id in sorted(trainers, key=pod_order)}

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

    def note_syncs(self, pods: tuple[Pod, ...], version: int, seconds: dict[str, float]) -> None:
        """After a step's weight sync to ``version`` of ``pods``: each pod in ``seconds``
        (pod id → seconds of its sync) had its trainer publish ``version`` and its generator
        apply it; the others were lost meanwhile and leave."""
        for pod in pods:
            if pod.id in seconds:
                with self._lock:
                    self._synced[pod.id] = (pod, version)
            else:
                self.drop(pod.id, "lost during the weight sync")

    def take_synced(self) -> dict[str, tuple[Pod, int]]:
        """The syncs that succeeded since the last call (one align reads them: a retry's
        align asks every pod again)."""
        with self._lock:
            synced, self._synced = self._synced, {}
            return synced

    # -- status ----------------------------------------------------------------------------------
    def status(self) -> list[PodStatus]:
        """Every pod the controller knows of: admitted ones first, by ordinal."""
        members = self.pod_members()
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
