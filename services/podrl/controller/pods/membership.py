"""Controller side of membership: who is registered, who is healthy, which pods are complete.

The registry is bounded: worker ids, addresses and incarnations are validated and bounded in
length, at most ``max_members`` processes are registered at once, and a member not heard from
for ``expire_after_seconds`` is removed. A (worker id, component) that a live process holds is
not taken over by a process at another address until the holder drains, is marked unreachable
or stops heartbeating.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from podrl.common.auth import worker_id_problem
from podrl.v1 import controller_pb2

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


class MemberRegistry:
    """Thread-safe table of registered processes, keyed by (worker_id, component); bounded
    (see the module docstring). ``expire_after_seconds`` defaults to six heartbeat timeouts,
    at least a minute."""

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
        self._lock = threading.Lock()
        self._members: dict[tuple[str, int], Member] = {}

    def _expire(self, now: float) -> None:
        """Forget members not heard from for ``expire_after_seconds`` (lock held)."""
        gone = [k for k, m in self._members.items() if now - m.last_seen > self._expire_after]
        for key in gone:
            del self._members[key]

    def register(self, worker_id: str, component: int, address: str, incarnation: str) -> None:
        """Add or replace the member; raises RegistrationError (a bad field), WorkerIdTakenError
        or RegistryFullError, leaving the registry as it was."""
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
