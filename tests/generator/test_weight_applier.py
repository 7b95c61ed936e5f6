"""``WeightApplier`` with vLLM's workers faked (the real ones: test_generator_service.py,
test_weight_faults.py): the typed call and replies (podrl.generator.worker_extension), the status
table, the one writer of the mirror of the workers' weight state. No engine."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from podrl.config.generator import GeneratorConfig
from podrl.generator.engine_runtime import EngineLoop
from podrl.generator.errors import GeneratorUnavailableError
from podrl.generator.servicer import APPLY_FAILURE_STATUS
from podrl.generator.sleep_mode import SleepMode
from podrl.generator.weight_applier import UNSUPPORTED, WeightApplier, WeightApplyError
from podrl.generator.worker_extension import (
    ApplyRequest,
    ErrorKind,
    WorkerReply,
)
from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind
from podrl.weights.protocol import GeneratorKey
from tests.generator.appliers import SERVED, signed_applier

NEEDS_FULL = SERVED.needs_full("applying version 4 failed part-way")


class Workers:
    """An engine whose workers answer every apply with ``replies`` (wire form)."""

    def __init__(self, *replies: WorkerReply) -> None:
        self.replies = [r.to_wire() for r in replies]
        self.requests: list[ApplyRequest] = []

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        assert method == "podrl_apply_manifest"
        (wire,) = args
        self.requests.append(ApplyRequest.from_wire(wire))
        return self.replies

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True


@pytest.fixture
def loop() -> Iterator[EngineLoop]:
    engine_loop = EngineLoop()
    engine_loop.start()
    yield engine_loop
    engine_loop.stop()


def _applier(
    tmp_path: Path, loop: EngineLoop, workers: Workers
) -> tuple[WeightApplier, weights_pb2.WeightManifest]:
    """An applier for ``workers``, and a manifest of version 4 signed with its key."""
    applier, key = signed_applier(tmp_path, GeneratorConfig(weight_copy_streams=2), workers, loop)
    manifest = weights_pb2.WeightManifest(version=4, model_fingerprint="storage-a")
    key.sign(manifest)
    return applier, manifest


def _apply(tmp_path: Path, loop: EngineLoop, workers: Workers, rollback: bool = False) -> Any:
    applier, manifest = _applier(tmp_path, loop, workers)
    return applier.apply(manifest, timeout=30, rollback=rollback)


def test_one_typed_request_reaches_the_workers(tmp_path: Path, loop: EngineLoop) -> None:
    workers = Workers(WorkerReply(SERVED, mode="in_place", plan_cached=True, seconds=0.01))
    result = _apply(tmp_path, loop, workers, rollback=True)
    (request,) = workers.requests
    assert weights_pb2.WeightManifest.FromString(request.manifest).version == 4
    assert request.trusted_publisher_id == "trainer-1"
    assert request.copy_streams == 2  # generator.weight_copy_streams
    assert request.rollback is True
    assert request.segment_owner_uid is not None  # the key file's owner
    assert (result.mode, result.plan_cached) == ("in_place", True)


def test_a_refusal_by_every_worker_is_the_manifest_error_again(
    tmp_path: Path, loop: EngineLoop
) -> None:
    refusal = ManifestError(ManifestErrorKind.SHAPE, "w: global_shape (2,)", name="w")
    workers = Workers(*[WorkerReply.refused(refusal, SERVED)] * 2)
    with pytest.raises(ManifestError) as raised:
        _apply(tmp_path, loop, workers)
    assert (raised.value.kind, raised.value.name) == (ManifestErrorKind.SHAPE, "w")
    assert raised.value.status_code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("replies", "kind", "status"),
    [
        (
            [WorkerReply(SERVED, error_kind=ErrorKind.FAILED_KEEPS_SERVING, error="OSError: x")],
            ErrorKind.FAILED_KEEPS_SERVING,
            grpc.StatusCode.ABORTED,
        ),
        (
            [WorkerReply(NEEDS_FULL, error_kind=ErrorKind.FAILED_NEEDS_FULL, error="OSError: x")],
            ErrorKind.FAILED_NEEDS_FULL,
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
        # One worker refused, the other applied: they disagree, so the weights are unknown.
        (
            [
                WorkerReply.refused(ManifestError(ManifestErrorKind.STORAGE, "gone"), SERVED),
                WorkerReply(SERVED.begin(4).commit("storage-a"), mode="in_place"),
            ],
            ErrorKind.FAILED_NEEDS_FULL,
            grpc.StatusCode.FAILED_PRECONDITION,
        ),
    ],
)
def test_a_failed_apply_carries_the_kind_that_picks_its_status(
    tmp_path: Path,
    loop: EngineLoop,
    replies: list[WorkerReply],
    kind: ErrorKind,
    status: grpc.StatusCode,
) -> None:
    with pytest.raises(WeightApplyError) as raised:
        _apply(tmp_path, loop, Workers(*replies))
    assert raised.value.kind is kind
    assert APPLY_FAILURE_STATUS[raised.value.kind] == status


def test_requests_and_replies_cross_collective_rpc_as_plain_values() -> None:
    """With its engine core in a process of its own vLLM sends utility-call arguments and
    results through msgpack (a dataclass arrives as a map, an enum member as its value); in
    process they arrive as sent. The wire form reads back to the same message either way."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    request = ApplyRequest(
        b"\x08\x04", "auto", "trainer-1", copy_streams=2, rollback=True, segment_owner_uid=7
    )
    refusal = ManifestError(ManifestErrorKind.STORAGE, "gone", name="w")
    replies = [
        WorkerReply(SERVED, mode="repack", plan_cached=True, seconds=0.5),
        WorkerReply.refused(refusal, SERVED),
        WorkerReply(NEEDS_FULL, error_kind=ErrorKind.FAILED_NEEDS_FULL, error="OSError: x"),
    ]
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder()
    crossed = decoder.decode(encoder.encode(request.to_wire()))
    assert ApplyRequest.from_wire(crossed) == request
    for reply in replies:
        assert WorkerReply.from_wire(decoder.decode(encoder.encode(reply.to_wire()))) == reply


def test_the_mirror_of_the_workers_state_has_one_writer(tmp_path: Path, loop: EngineLoop) -> None:
    """Only ``WeightApplier`` assigns the mirror (``_state``); others read ``state``."""
    package = Path(__file__).resolve().parents[2] / "services/podrl/generator"
    writers = {
        path.name
        for path in package.glob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "_state"
        and isinstance(node.ctx, ast.Store)
    }
    assert writers == {"weight_applier.py"}
    applier = WeightApplier(
        GeneratorConfig(),
        Workers(),
        loop,
        state=SERVED,
        in_flight_apply=UNSUPPORTED,
        parameter_count=4,
        trusted_publisher_id="trainer-1",
        key=GeneratorKey({}),
    )
    with pytest.raises(AttributeError):
        applier.state = NEEDS_FULL  # type: ignore[misc]


class SleepingWorkers(Workers):
    """Workers of an engine with vLLM's sleep mode (level 1: nothing asked of the workers)."""

    async def sleep(self, level: int = 1) -> None:
        pass

    async def wake_up(self) -> None:
        pass


def test_a_sleeping_generator_refuses_applies_before_the_workers_see_them(
    tmp_path: Path, loop: EngineLoop
) -> None:
    """The sleep level is kept in the applier, beside the weight lock: every apply and Generate
    checks it there (``require_awake``), so neither runs the sleep mode's code."""
    workers = SleepingWorkers(WorkerReply(SERVED.begin(4).commit("storage-a"), mode="in_place"))
    applier, manifest = _applier(tmp_path, loop, workers)
    sleep_mode = SleepMode(GeneratorConfig(enable_sleep_mode=True), "cuda", workers, loop, applier)
    sleep_mode.sleep(1, timeout=30)
    assert sleep_mode.sleeping
    with pytest.raises(GeneratorUnavailableError, match="asleep"):
        applier.apply(manifest, timeout=30)
    with pytest.raises(GeneratorUnavailableError, match="asleep"):
        applier.require_awake()  # what Generation.generate checks under the read lock
    assert workers.requests == []
    sleep_mode.wake_up(timeout=30)
    assert applier.apply(manifest, timeout=30).policy_version == 4
    assert len(workers.requests) == 1
