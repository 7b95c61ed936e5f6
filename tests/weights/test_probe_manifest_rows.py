"""Probe rows 11-14 of 2026-12-01 (OK rows, kept OK): the parts of them no other test sends.
Shared-memory names with ``..``, a ``/`` or an absolute path, a shard's offset outside its
segment and strides that are not contiguous are refused by the receiver (real shared memory)
with the kind and field named, and nothing is copied; the good manifest still applies.

Names, shapes, dtypes, missing tensors, fingerprints and publishers: tests/weights/
test_bad_manifests.py and (through a real generator, with stale versions)
tests/generator/test_generator_service.py; version order: tests/generator/test_weight_state.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from podrl.v1 import weights_pb2
from tests.weights.manifest_cases import (
    INVALID,
    KEY,
    NORM,
    PRECONDITION,
    Kind,
    Trainer,
    assert_refused,
    copy_manifest,
    make_receiver,
    shard_of,
)

Change = Callable[[weights_pb2.WeightManifest], None]


def _rename_norm_segment(name: Callable[[str], str]) -> Change:
    def change(manifest: weights_pb2.WeightManifest) -> None:
        old = shard_of(manifest, NORM).storage.shm.name
        for shard in manifest.shards:  # every shard of that segment, so they agree
            if shard.storage.shm.name == old:
                shard.storage.shm.name = name(old)

    return change


SEGMENT_NAMES = {
    "parent dirs": _rename_norm_segment(lambda _: "../../etc/passwd"),
    "absolute": _rename_norm_segment(lambda _: "/etc/passwd"),
    "inside a real name": _rename_norm_segment(lambda old: f"{old}/../{old}"),
}


@pytest.mark.parametrize("change", SEGMENT_NAMES.values(), ids=SEGMENT_NAMES.keys())
def test_segment_names_outside_shared_memory_are_refused(trainer: Trainer, change: Change) -> None:
    good = trainer.publish(1)
    bad = copy_manifest(good)
    change(bad)
    KEY.sign(bad)
    message = assert_refused(make_receiver(), bad, Kind.STORAGE, PRECONDITION)
    assert "is not a podrl segment" in message
    receiver = make_receiver()
    assert dict(receiver.apply(good))[NORM].equal(trainer.params[NORM])


def test_an_offset_outside_the_segment_is_refused_naming_segment_nbytes(trainer: Trainer) -> None:
    good = trainer.publish(1)
    bad = copy_manifest(good)
    handle = shard_of(bad, NORM).storage.shm
    handle.offset = handle.segment_nbytes
    KEY.sign(bad)
    message = assert_refused(make_receiver(), bad, Kind.SHAPE, INVALID)
    assert NORM in message and "segment_nbytes" in message


def test_strides_that_are_not_contiguous_are_refused(trainer: Trainer) -> None:
    good = trainer.publish(1)
    bad = copy_manifest(good)
    shard = next(s for s in bad.shards if len(s.local_shape) == 2)
    shard.stride[0] += 1
    KEY.sign(bad)
    message = assert_refused(make_receiver(), bad, Kind.SHAPE, INVALID)
    assert shard.name in message and "contiguous" in message
