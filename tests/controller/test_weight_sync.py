"""Aligning generators: one whose weights are unsettled gets a full manifest even when it names
the trainer's version (a failed or overrun ApplyWeights leaves it needing one)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from podrl.config.transport import GrpcConfig
from podrl.controller.step.pod_calls import WeightSync, WorkerClients
from tests.controller.fake_workers import FakePod


@pytest.fixture
def pod(tmp_path: Path) -> Iterator[FakePod]:
    pod = FakePod(tmp_path / "checkpoints")
    pod.trainer.version = pod.generator.version = 3
    yield pod
    pod.stop()


@pytest.fixture
def sync(pod: FakePod) -> Iterator[WeightSync]:
    clients = WorkerClients(GrpcConfig())
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield WeightSync(clients, pool)
    clients.close()


@pytest.mark.parametrize("state", ["needs_full", "applying"])
def test_an_unsettled_generator_at_the_trainers_version_gets_a_full_manifest(
    pod: FakePod, sync: WeightSync, state: str
) -> None:
    pod.generator.weight_state = state
    sync.bring_generator_to(pod.pod, 3)
    assert [(m.version, m.version_only) for m in pod.generator.applied] == [(3, False)]
    assert pod.generator.weight_state == "idle"
    assert pod.trainer.acknowledged == [3]


def test_a_settled_generator_at_the_trainers_version_is_left_alone(
    pod: FakePod, sync: WeightSync
) -> None:
    sync.bring_generator_to(pod.pod, 3)
    assert pod.generator.applied == []
    assert pod.trainer.acknowledged == [3]


def test_a_generator_needing_a_full_manifest_mid_sync_is_sent_one(
    pod: FakePod, sync: WeightSync
) -> None:
    sync.sync(pod.pod, 3)  # the first publish is full; the generator caches it
    pod.trainer.version = 4
    pod.generator.weight_state = "needs_full"  # e.g. its last apply overran its deadline
    sync.sync_with_retries(pod.pod, 4, attempts=1)
    assert [(m.version, m.version_only) for m in pod.generator.applied] == [
        (3, False),
        (4, True),  # refused: FAILED_PRECONDITION
        (4, False),
    ]
    assert pod.generator.version == 4


def test_in_flight_syncs_hold_no_gate_and_rollbacks_do(pod: FakePod) -> None:
    """loop.weight_apply: in_flight: ApplyWeights asks for an in-flight apply outside the
    `applying` context (the generator gate); a rollback is applied between batches, inside it,
    and never asks for in flight (the generator refuses that pair)."""
    held: list[bool] = []
    inside = False

    @contextmanager
    def applying() -> Iterator[None]:
        nonlocal inside
        inside = True
        try:
            yield
        finally:
            inside = False

    clients = WorkerClients(GrpcConfig())
    pod.generator.on_apply = lambda: held.append(inside)
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            sync = WeightSync(clients, pool, applying=applying, in_flight=True)
            pod.trainer.version = 4
            sync.sync(pod.pod, 4)
            pod.generator.version = 5  # ahead of its trainer (restarted from a checkpoint)
            sync.bring_generator_to(pod.pod, 4)
    finally:
        clients.close()
    assert pod.generator.applied_in_flight == [True, False]
    assert held == [False, True]
    assert [m.version for m in pod.generator.applied] == [4, 4]
