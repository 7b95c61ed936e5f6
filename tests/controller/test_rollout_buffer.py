"""The rollout buffer's parts without any service: the bound, the producer's order and
retries, and the generator gate (services/podrl/controller/rollout/producer.py)."""

from __future__ import annotations

import threading
import time

import pytest

from podrl.config.loop import LoopConfig
from podrl.controller.rollout.gate import GeneratorGate
from podrl.controller.rollout.producer import (
    RolloutProducer,
    ScoredBatch,
    buffer_capacity_steps,
    may_start,
)
from podrl.controller.step.batch import StepSamples
from podrl.controller.step_errors import RunFailedError, StepFailedError

POLL = LoopConfig().stop_poll_seconds


def test_the_bound_lets_the_producer_run_max_staleness_steps_ahead() -> None:
    assert may_start(1, 0, 0) and not may_start(2, 0, 0)  # k = 0: the synchronous order
    assert may_start(2, 0, 1) and not may_start(3, 0, 1)
    assert may_start(5, 2, 2) and not may_start(6, 2, 2)
    assert buffer_capacity_steps(0) == 1 and buffer_capacity_steps(3) == 4


def _batch(step: int, error: StepFailedError | None = None) -> ScoredBatch:
    return ScoredBatch(step, StepSamples(items=[]), {"at": step - 1}, {"at": step}, error=error)


def _scored(batch: ScoredBatch) -> None:
    """A score phase with nothing to score (these batches have no samples)."""


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_the_producer_makes_steps_in_order_never_beyond_the_bound(max_staleness: int) -> None:
    started: list[tuple[int, int]] = []  # (step, steps done when its batch started)
    done = {"n": 0}

    def produce(step: int, failed: ScoredBatch | None) -> ScoredBatch:
        started.append((step, done["n"]))
        return _batch(step)

    producer = RolloutProducer(
        produce, _scored, max_staleness=max_staleness, last_step=8, stopped=bool, poll_seconds=POLL
    )
    producer.start(1)
    try:
        for step in range(1, 9):
            batch = producer.take(step)
            assert batch is not None and batch.step == step
            time.sleep(0.02)  # the producer may run ahead meanwhile, up to the bound
            steps_in_buffer, _ = producer.fill()
            assert steps_in_buffer <= max_staleness
            done["n"] = step
            producer.step_done(step)
    finally:
        producer.close()
    assert [step for step, _ in started] == list(range(1, 9))
    assert all(step <= before + 1 + max_staleness for step, before in started)
    assert any(step == before + 1 + max_staleness for step, before in started)


def test_a_failed_batch_is_handed_over_and_made_again_only_when_asked() -> None:
    calls: list[tuple[int, bool]] = []

    def produce(step: int, failed: ScoredBatch | None) -> ScoredBatch:
        calls.append((step, failed is not None))
        if step == 2 and failed is None:
            return _batch(2, StepFailedError("generate", "injected"))
        if failed is not None:  # the same prompts and positions, made again
            return ScoredBatch(step, failed.data, failed.position_before, failed.position_after)
        return _batch(step)

    producer = RolloutProducer(
        produce, _scored, max_staleness=2, last_step=3, stopped=bool, poll_seconds=POLL
    )
    producer.start(1)
    try:
        assert producer.take(1) is not None
        producer.step_done(1)
        with pytest.raises(StepFailedError, match="injected"):
            producer.take(2)
        time.sleep(0.3)
        assert (3, False) not in calls  # nothing else is made while the failure waits
        producer.retry(2)
        again = producer.take(2)
        assert again is not None and again.position_before == {"at": 1}  # the same prompts
        producer.step_done(2)
        assert producer.take(3) is not None
    finally:
        producer.close()
    assert calls == [(1, False), (2, False), (2, True), (3, False)]


def test_a_batch_scores_while_the_next_one_generates() -> None:
    # Scoring step 1 waits for step 2's generation to start: a producer that scored each
    # batch before generating the next would never start it (the wait times out: False).
    generating_2 = threading.Event()
    overlapped: list[bool] = []

    def generate(step: int, failed: ScoredBatch | None) -> ScoredBatch:
        if step == 2:
            generating_2.set()
        return _batch(step)

    def score(batch: ScoredBatch) -> None:
        if batch.step == 1:
            overlapped.append(generating_2.wait(5))
        batch.seconds["score"] = 0.0

    producer = RolloutProducer(
        generate, score, max_staleness=1, last_step=2, stopped=bool, poll_seconds=POLL
    )
    producer.start(1)
    try:
        first = producer.take(1)
        assert first is not None and "score" in first.seconds  # scored before it is handed over
        producer.step_done(1)
        assert producer.take(2) is not None
    finally:
        producer.close()
    assert overlapped == [True]


def test_a_failed_score_is_handed_over_and_the_step_made_again_with_its_prompts() -> None:
    calls: list[tuple[int, bool]] = []
    scored: list[int] = []
    failure_seen = threading.Event()

    def generate(step: int, failed: ScoredBatch | None) -> ScoredBatch:
        calls.append((step, failed is not None))
        if step == 2:  # generating while step 1's scoring fails; done once the loop saw it
            assert failure_seen.wait(5)
        if failed is not None:
            return ScoredBatch(step, failed.data, failed.position_before, failed.position_after)
        return _batch(step)

    def score(batch: ScoredBatch) -> None:
        scored.append(batch.step)
        if scored == [1]:
            batch.error = StepFailedError("score", "injected")

    producer = RolloutProducer(
        generate, score, max_staleness=2, last_step=3, stopped=bool, poll_seconds=POLL
    )
    producer.start(1)
    try:
        with pytest.raises(StepFailedError, match="injected"):
            producer.take(1)
        failure_seen.set()
        time.sleep(0.3)
        assert (3, False) not in calls  # the bound allows step 3; the failure holds it back
        producer.retry(1)
        again = producer.take(1)
        assert again is not None and again.position_before == {"at": 0}  # the same prompts
        producer.step_done(1)
        assert producer.take(2) is not None  # generated before the failure: kept
        producer.step_done(2)
        assert producer.take(3) is not None
    finally:
        producer.close()
    assert calls == [(1, False), (2, False), (1, True), (3, False)]
    assert scored == [1, 2, 1, 3]


def test_a_producer_that_crashes_fails_the_run_and_a_stop_ends_the_wait() -> None:
    def crash(step: int, failed: ScoredBatch | None) -> ScoredBatch:
        raise RuntimeError("the source broke")

    producer = RolloutProducer(
        crash, _scored, max_staleness=1, last_step=3, stopped=bool, poll_seconds=POLL
    )
    producer.start(1)
    with pytest.raises(RunFailedError, match="the source broke"):
        producer.take(1)
    producer.close()
    stop = threading.Event()
    idle = RolloutProducer(
        lambda s, f: _batch(s),
        _scored,
        max_staleness=0,
        last_step=3,
        stopped=stop.is_set,
        poll_seconds=POLL,
    )
    idle.start(1)
    assert idle.take(1) is not None
    stop.set()
    assert idle.take(2) is None  # step 1 never reported done: the producer waits, the run stops
    idle.close()


def test_the_gate_lets_the_loop_in_before_the_producer_starts_another_batch() -> None:
    gate = GeneratorGate(POLL)
    order: list[str] = []
    first_batch = threading.Event()

    def producer() -> None:
        for n in range(3):
            with gate.producer(lambda: False) as held:
                assert held
                order.append(f"batch {n} start")
                first_batch.set()
                time.sleep(0.1)
                order.append(f"batch {n} end")

    thread = threading.Thread(target=producer)
    thread.start()
    first_batch.wait()
    with gate.loop():
        order.append("sync")
    thread.join()
    # The sync waited for batch 0 to end and ran before batch 1 started: never inside one.
    assert order[:3] == ["batch 0 start", "batch 0 end", "sync"]
    assert order.count("sync") == 1
    assert len(order) == 7


def test_the_loop_side_of_the_gate_is_shared_by_its_threads_and_excludes_the_producer() -> None:
    gate = GeneratorGate(POLL)
    both_in = threading.Barrier(3, timeout=5)
    order: list[str] = []

    def apply(name: str) -> None:
        with gate.loop():  # as a sync applies to two pods' generators at once
            both_in.wait()  # a broken barrier (timeout) if one thread waited for the other
            time.sleep(0.1)
            order.append(f"{name} out")

    threads = [threading.Thread(target=apply, args=(name,)) for name in ("pod-0", "pod-1")]
    for thread in threads:
        thread.start()
    both_in.wait()  # both hold the loop side now
    with gate.producer(lambda: False) as held:
        assert held
        order.append("batch")
    for thread in threads:
        thread.join()
    assert order[-1] == "batch"  # the producer waited for both applies to end
    assert len(order) == 3
