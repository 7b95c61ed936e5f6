"""fan_out leaves no call running behind it: a retry never overlaps the call it retries."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from podrl.controller.pods.clients import fan_out


def test_on_the_first_failure_fan_out_returns_only_when_no_call_is_running() -> None:
    started: set[str] = set()
    finished: set[str] = set()
    failing = threading.Event()
    lock = threading.Lock()

    def call(name: str, fail: bool = False) -> str:
        with lock:
            started.add(name)
        if fail:
            failing.set()
            raise RuntimeError(f"{name} failed")
        failing.wait()
        time.sleep(0.2)  # still busy when the failure is raised
        with lock:
            finished.add(name)
        return name

    with ThreadPoolExecutor(max_workers=2) as pool:
        calls = [lambda: call("a", fail=True), lambda: call("b"), lambda: call("c")]
        with pytest.raises(RuntimeError, match="a failed"):
            fan_out(pool, calls)
        with lock:
            running = started - finished - {"a"}
        # The old fan_out raised at once, with b (and perhaps c) still running.
        assert running == set()
        assert "b" in finished


def test_fan_out_returns_results_in_call_order() -> None:
    with ThreadPoolExecutor(max_workers=4) as pool:
        assert fan_out(pool, [lambda i=i: i * i for i in range(6)]) == [0, 1, 4, 9, 16, 25]
