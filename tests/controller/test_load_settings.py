"""The loop's settings that act under load reach where they act: the thread pool of the loop's
calls to the pods (controller.loop_call_threads) and the waits of async mode that look at the
stop flag (loop.stop_poll_seconds), in the loop that build_loop makes (docs/config.md, "Under
load")."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from podrl.common.processes import free_port
from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import RunStore
from podrl.controller.service.main import build_loop
from podrl.controller.service.status import RunState
from podrl.controller.step.async_steps import AsyncSteps
from podrl.controller.step.loop import GrpoLoop
from podrl.controller.step.pod_calls import WorkerClients
from podrl.tasks import build_task_source
from tests.controller.fake_pod_loop import loop_config

POLL = 0.6  # longer than the default 0.2 s, so a wait of the default's length shows
THREADS = 3  # fewer than the default 16


@pytest.fixture
def built(tmp_path: Path) -> Iterator[tuple[GrpoLoop, threading.Event]]:
    config = loop_config(tmp_path / "run", free_port(), mode="async", stop_poll_seconds=POLL)
    config.controller.loop_call_threads = THREADS
    table = PodTable(60)
    state = RunState(config.name, table, 1, config.loop.steps)
    store = RunStore(tmp_path / "controller.sqlite")
    clients = WorkerClients(config.grpc, None)
    stop = threading.Event()
    loop = build_loop(config, state, store, clients, build_task_source(config.tasks), table, stop)
    try:
        yield loop, stop
    finally:
        loop.parts.pool.shutdown(wait=False, cancel_futures=True)
        clients.close()
        store.close()


def test_the_loop_calls_the_pods_on_loop_call_threads(
    built: tuple[GrpoLoop, threading.Event],
) -> None:
    loop, _ = built
    running, release = [], threading.Event()

    def call() -> None:
        running.append(1)
        release.wait(10)

    for _ in range(THREADS + 2):
        loop.parts.pool.submit(call)
    time.sleep(0.3)  # every call that has a thread is in it by now
    release.set()
    assert len(running) == THREADS


def _waited(stop: threading.Event, fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took when the stop flag is set (without a wake-up) once it waits."""
    threading.Timer(0.05, stop.set).start()
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def test_the_gate_and_the_producer_look_at_the_stop_flag_every_stop_poll_seconds(
    built: tuple[GrpoLoop, threading.Event],
) -> None:
    loop, stop = built
    gate = loop.parts.gate

    def producer_waits_for_the_gate() -> None:
        with gate.loop(), gate.producer(stop.is_set) as held:
            assert not held

    # A Condition wait without a wake-up ends at its timeout, never sooner: each wait that
    # noticed the stop lasted at least one poll.
    assert _waited(stop, producer_waits_for_the_gate) >= POLL - 0.05
    stop.clear()
    driver = loop.driver
    assert isinstance(driver, AsyncSteps)
    assert _waited(stop, lambda: driver.producer.take(1)) >= POLL - 0.05
