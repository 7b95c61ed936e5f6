"""The controller's fan-outs leave no call running behind them: a retry never overlaps the call
it retries (e.g. two ApplyWeights to the same generator).

Both fan-outs production uses are checked: ``phases.settle`` (align's Info and generator
syncs, Generate and Score) and ``WeightSync._every_pod`` (the weight sync and the wake-up).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from podrl.config.transport import GrpcConfig
from podrl.controller.pods.clients import WorkerClients
from podrl.controller.pods.roster import Pod
from podrl.controller.step.phases import settle
from podrl.controller.step.weight_sync import WeightSync


class _Calls:
    """Call "a" fails at once; the others are still busy when it does."""

    def __init__(self) -> None:
        self.started: set[str] = set()
        self.finished: set[str] = set()
        self._failing = threading.Event()
        self._lock = threading.Lock()

    def call(self, name: str) -> str:
        with self._lock:
            self.started.add(name)
        if name == "a":
            self._failing.set()
            raise RuntimeError("a failed")
        self._failing.wait()
        time.sleep(0.2)  # still busy when the failure comes back
        with self._lock:
            self.finished.add(name)
        return name

    def running(self) -> set[str]:
        with self._lock:
            return self.started - self.finished - {"a"}


def test_settle_returns_only_when_no_call_is_running_and_keeps_every_outcome() -> None:
    calls = _Calls()
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = settle(pool, [lambda n=n: calls.call(n) for n in "abc"])
        assert calls.running() == set()
    assert isinstance(outcomes[0], RuntimeError) and outcomes[1:] == ["b", "c"]


def test_settle_returns_results_in_call_order() -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert settle(pool, [lambda i=i: i * i for i in range(6)]) == [0, 1, 4, 9, 16, 25]


def _pod(name: str) -> Pod:
    return Pod(name, f"{name}:1", f"{name}:2", f"{name}:3")


@pytest.mark.parametrize("sync", ["sync_pods", "wake_pods"])
def test_the_weight_sync_raises_a_pods_failure_only_when_no_pods_call_is_running(
    sync: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _Calls()
    clients = WorkerClients(GrpcConfig())
    with ThreadPoolExecutor(max_workers=2) as pool:
        weights = WeightSync(clients, pool)

        def per_pod(pod: Pod, *args: object) -> float:
            calls.call(pod.id)
            return 0.1

        monkeypatch.setattr(weights, "sync_with_retries", per_pod)
        monkeypatch.setattr(weights, "_retried", lambda what, rpc, why, pod, *a: per_pod(pod))
        pods = [_pod(n) for n in "abc"]
        with pytest.raises(RuntimeError, match="a failed"):
            if sync == "sync_pods":
                weights.sync_pods(pods, 4, attempts=1)
            else:
                weights.wake_pods(pods, attempts=1)
        assert calls.running() == set()
        assert calls.finished == {"b", "c"}
    clients.close()
