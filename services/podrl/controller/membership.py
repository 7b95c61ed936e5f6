"""Controller side of membership: who is registered, who is healthy, which pods are complete."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

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
    """Thread-safe table of registered processes, keyed by (worker_id, component)."""

    def __init__(
        self, heartbeat_timeout_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._timeout = heartbeat_timeout_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._members: dict[tuple[str, int], Member] = {}

    def register(self, worker_id: str, component: int, address: str, incarnation: str) -> None:
        if component not in COMPONENT_NAMES:
            raise ValueError(f"unknown component {component}")
        with self._lock:
            self._members[(worker_id, component)] = Member(
                worker_id=worker_id,
                component=component,
                address=address,
                incarnation=incarnation,
                state=controller_pb2.WORKER_STATE_SERVING,
                last_seen=self._clock(),
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
        with self._lock:
            member = self._members.get((worker_id, component))
            if member is None or (incarnation and member.incarnation != incarnation):
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

    def healthy_addresses(self, component: int) -> list[str]:
        now = self._clock()
        with self._lock:
            return sorted(
                m.address
                for m in self._members.values()
                if m.component == component and self._healthy(m, now)
            )
