"""A step's fan-outs wait for every call before a failure is handled (docs/controller.md,
"Failure rules"): nothing is cancelled, a pod's reply is kept when another pod's call failed,
and a retry never overlaps the call it retries."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from podrl.controller.step.pod_calls import WeightSync, settle


def _calls(finished: set[str]) -> Callable[[str], str]:
    """A call per pod: "a" fails at once, the others are still busy then and finish later."""
    failed = threading.Event()

    def call(name: str) -> str:
        if name == "a":
            failed.set()
            raise RuntimeError("a failed")
        failed.wait()
        time.sleep(0.2)  # still busy when the first call has failed
        finished.add(name)
        return name

    return call


def test_generate_and_score_keep_every_reply_and_return_when_no_call_runs() -> None:
    finished: set[str] = set()
    call = _calls(finished)
    # One worker: "b" and "c" start only once "a" has failed, so cancelling what had not
    # started would lose their replies.
    with ThreadPoolExecutor(max_workers=1) as pool:
        outcomes = settle(pool, [lambda n=n: call(n) for n in ("a", "b", "c")])
        assert finished == {"b", "c"}  # inside the block: leaving it waits for the calls
    assert isinstance(outcomes[0], RuntimeError) and outcomes[1:] == ["b", "c"]


def test_a_failed_apply_is_raised_only_after_every_pods_apply_ended() -> None:
    finished: set[str] = set()
    call = _calls(finished)

    def apply(pod: SimpleNamespace) -> None:
        call(pod.id)

    pods = [SimpleNamespace(id=n) for n in ("a", "b", "c")]
    with ThreadPoolExecutor(max_workers=3) as pool:
        # _every_pod reads only the sync's pool: the fan-out of the sync's ApplyWeights calls.
        sync = SimpleNamespace(_pool=pool)
        with pytest.raises(RuntimeError, match="a failed"):
            WeightSync._every_pod(sync, pods, apply)  # type: ignore[arg-type]
        # Inside the pool's block: leaving it would wait for the calls itself.
        assert finished == {"b", "c"}
