"""The pod table keeps which pods are joining in one place, and asking for the lead pod admits
none."""

from __future__ import annotations

from podrl.controller.pods.table import PodPhase, PodTable


def _roster(*pods: str) -> PodTable:
    roster = PodTable(heartbeat_timeout_seconds=60)
    for n, pod in enumerate(pods):
        for component in (1, 2, 3):
            roster.register(pod, component, f"127.0.0.1:{50000 + 10 * n + component}", "inc")
    return roster


def test_joining_is_set_by_the_aligns_versions_and_cleared_once_the_trainer_trained() -> None:
    roster = _roster("pod-0", "pod-1")
    roster.admit()
    roster.settle_versions({"pod-0": 3, "pod-1": 1}, expected=3)
    assert roster.joining() == {"pod-1"}
    states = {row.id: row.state for row in roster.status()}
    assert states == {"pod-0": PodPhase.TRAINING, "pod-1": PodPhase.JOINING}
    roster.note_trained({"pod-0": 4, "pod-1": 4})
    assert roster.joining() == frozenset()
    assert {row.state for row in roster.status()} == {PodPhase.TRAINING}


def test_asking_for_the_lead_pod_admits_none() -> None:
    roster = _roster("pod-0", "pod-1")
    assert roster.lead().id == "pod-0"
    # Before, an empty roster admitted the pods here: a new epoch outside any step boundary.
    assert roster.epoch == 0 and roster.pods() == []


def test_the_roster_remembers_syncs_until_the_next_align_and_which_pods_were_replaced() -> None:
    roster = _roster("pod-0")
    [pod] = roster.admit()
    assert roster.replaced([pod]) == []
    roster.note_syncs((pod,), 4, {pod.id: 0.1})
    assert roster.take_synced() == {"pod-0": (pod, 4)}
    assert roster.take_synced() == {}  # one align reads them: a retry's align asks again
    # The trainer restarted under the same worker id: the pod as admitted before is stale.
    roster.register("pod-0", 3, "127.0.0.1:50003", "inc-2")
    [again] = roster.admit()
    assert again != pod and roster.replaced([again]) == [pod]
    assert roster.replaced([again]) == []
