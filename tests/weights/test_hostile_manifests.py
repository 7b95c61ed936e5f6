"""Manifests from someone other than the pod's trainer, storage that is not the trainer's, and
weights that are not numbers: refused with the right kind before anything is copied.

Each test names the row of the 2026-12-01 probe (docs of the probe: the project's reviews) it
reproduces; every one of them was accepted by the receiver before these checks existed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from podrl.v1 import weights_pb2
from podrl.weights import (
    PublishError,
    protocol,
)
from podrl.weights.errors import ManifestError
from podrl.weights.protocol import WeightsKey, contiguous_strides, manifest_mac
from podrl.weights.receiver import MAX_SHARDS_PER_TENSOR, check_shard_count
from tests.weights.manifest_cases import (
    DENIED,
    DESCRIPTION,
    INVALID,
    KEY,
    NORM,
    PRECONDITION,
    Kind,
    assert_refused,
    copy_manifest,
    make_receiver,
    shard_of,
)

# ---- authenticity ----------------------------------------------------------------


def test_only_manifests_with_the_pods_mac_are_applied(trainer) -> None:
    """Before this check: a manifest from an unrelated process, publisher_id copied from Info, was
    accepted. Without the MAC of the pod's key, with another key's, or changed after signing,
    it is PERMISSION_DENIED; the trainer's own signed manifest applies."""
    receiver = make_receiver(key=KEY)
    good = trainer.publish(1)
    assert good.mac == manifest_mac(KEY.secret, good)

    unsigned = copy_manifest(good)
    unsigned.ClearField("mac")
    assert "no mac" in assert_refused(receiver, unsigned, Kind.UNAUTHENTIC, DENIED)

    other_key = copy_manifest(good)
    WeightsKey(b"x" * 32, os.geteuid()).sign(other_key)
    assert_refused(receiver, other_key, Kind.UNAUTHENTIC, DENIED)

    for change in ("version", "offset", "version_only"):
        changed = copy_manifest(good)
        if change == "version":
            changed.version = 7
        elif change == "offset":
            changed.shards[0].storage.shm.offset += 64
        else:
            changed.version_only = True
            del changed.shards[:]
        assert "does not match" in assert_refused(receiver, changed, Kind.UNAUTHENTIC, DENIED), (
            change
        )

    applied = dict(receiver.apply(good))
    assert torch.equal(applied[NORM], trainer.params[NORM])
    trainer.publisher.finish(1)
    # Version-only manifests are signed too (a forged one would re-use mapped storage).
    follow = trainer.publish(2)
    assert follow.version_only and follow.mac
    assert receiver.apply(follow).plan_cached


# ---- storage ---------------------------------------------------------------


@pytest.fixture
def planted() -> Iterator[Path]:
    """A path under /dev/shm with a podrl segment name of this (live) process."""
    path = protocol.SHM_DIR / protocol.segment_name()
    yield path
    path.unlink(missing_ok=True)


def _point_norm_at(manifest, name: str, segment_nbytes: int) -> weights_pb2.WeightManifest:
    forged = copy_manifest(manifest)
    handle = shard_of(forged, NORM).storage.shm
    handle.name, handle.offset, handle.segment_nbytes = name, 0, segment_nbytes
    return forged


def test_a_symlink_under_a_segment_name_is_never_followed(
    trainer, planted: Path, tmp_path: Path
) -> None:
    """Before this check: a /dev/shm/podrl-w-<pid>-<start>-x symlink to a system file was loaded as
    weights. Even pointing at a file of the right user and size, a symlink is refused."""
    target = tmp_path / "system-file"
    target.write_bytes(b"\x01" * 4096)
    planted.symlink_to(target)
    forged = _point_norm_at(trainer.publish(1, force_full=True), planted.name, 4096)
    message = assert_refused(make_receiver(), forged, Kind.STORAGE, PRECONDITION)
    assert NORM in message


def test_segments_must_be_regular_files_of_the_trainers_user_and_declared_size(
    trainer, planted: Path
) -> None:
    """A FIFO under a segment name is refused without blocking the open; a segment of another
    user, or of another size than the manifest declares, is refused too."""
    good = trainer.publish(1)
    os.mkfifo(planted, 0o600)
    assert_refused(
        make_receiver(), _point_norm_at(good, planted.name, 4096), Kind.STORAGE, PRECONDITION
    )

    message = assert_refused(
        make_receiver(segment_owner_uid=os.geteuid() + 1), good, Kind.STORAGE, PRECONDITION
    )
    assert "belongs to uid" in message

    resized = copy_manifest(good)
    handle = resized.shards[0].storage.shm
    for shard in resized.shards:  # every shard of that segment declares the wrong size
        if shard.storage.shm.name == handle.name:
            shard.storage.shm.segment_nbytes += 64
    assert "declares" in assert_refused(make_receiver(), resized, Kind.STORAGE, PRECONDITION)

    disagreeing = copy_manifest(good)
    first = disagreeing.shards[0].storage.shm
    other = next(s for s in disagreeing.shards[1:] if s.storage.shm.name == first.name).storage.shm
    other.segment_nbytes += 64
    assert "disagree" in assert_refused(make_receiver(), disagreeing, Kind.SHAPE, INVALID)

    assert dict(make_receiver().apply(good))[NORM].equal(trainer.params[NORM])


def test_a_wider_dtype_over_the_trainers_segment_is_refused(trainer) -> None:
    """Before this check: a shard declared FLOAT64 with nbytes of 8 over the trainer's live fp32
    segment was accepted and served garbage. nbytes must be numel x the dtype's size, and the
    bytes of one tensor may not overlap another's in the segment."""
    good = trainer.publish(1)
    receiver = make_receiver()

    eight_bytes = copy_manifest(good)
    shard = shard_of(eight_bytes, NORM)
    shard.dtype = weights_pb2.DTYPE_FLOAT64
    shard.storage.shm.nbytes = 8
    assert "nbytes" in assert_refused(receiver, eight_bytes, Kind.SHAPE, INVALID)

    # Consistent bytes for float64, but they run into the tensor packed after it.
    wide = copy_manifest(good)
    shards = sorted(
        (s for s in wide.shards if s.storage.shm.name == shard_of(wide, NORM).storage.shm.name),
        key=lambda s: s.storage.shm.offset,
    )
    victim = next(s for s in shards[:-1] if len(s.local_shape) == 1)
    victim.dtype = weights_pb2.DTYPE_FLOAT64
    victim.storage.shm.nbytes *= 2
    assert "overlap" in assert_refused(receiver, wide, Kind.SHAPE, INVALID)


# ---- bounded work ---------------------------------------------------------------


def _row_split(manifest, name: str, rows: int) -> weights_pb2.WeightManifest:
    """``name`` as ``rows`` one-row shards over its own bytes (a legitimate tiling)."""
    out = copy_manifest(manifest)
    whole = shard_of(out, name)
    row_bytes = whole.storage.shm.nbytes // whole.local_shape[0]
    for row in range(rows):
        piece = out.shards.add()
        piece.CopyFrom(whole)
        piece.local_shape[0] = 1
        piece.local_offset[0] = row
        piece.storage.shm.offset = whole.storage.shm.offset + row * row_bytes
        piece.storage.shm.nbytes = row_bytes
    out.shards.remove(whole)
    return out


def test_shard_counts_are_capped_before_any_shard_is_checked(trainer) -> None:
    """Before this check: 16,641 zero-size shards took quadratic time (a concurrent Generate waited
    90 s). Over the total cap the manifest is refused by its length alone (the generator's
    check before its locks); zero-size blocks and more shards per tensor than the cap are
    refused by the receiver."""
    good = trainer.publish(1)
    receiver = make_receiver()
    flood = copy_manifest(good)
    template = shard_of(flood, NORM)
    for _ in range(16_641):
        empty = flood.shards.add()
        empty.CopyFrom(template)
        empty.local_shape[0] = 0
        empty.storage.shm.nbytes = 0
    assert len(flood.shards) > MAX_SHARDS_PER_TENSOR * len(DESCRIPTION.params)
    # The generator checks the count in all before its locks, before a receiver sees it.
    with pytest.raises(ManifestError) as over_the_cap:
        check_shard_count(flood, len(DESCRIPTION.params))
    assert over_the_cap.value.kind is Kind.LIMIT and "16" in str(over_the_cap.value)
    assert over_the_cap.value.status_code == INVALID
    # A receiver alone stops at the first empty block: the flood costs it no more.
    assert_refused(receiver, flood, Kind.SHAPE, INVALID)

    one_empty = copy_manifest(good)
    extra = one_empty.shards.add()
    extra.CopyFrom(shard_of(one_empty, NORM))
    extra.local_shape[0] = 0
    extra.storage.shm.nbytes = 0
    assert "empty" in assert_refused(receiver, one_empty, Kind.SHAPE, INVALID)

    embed = "model.embed_tokens.weight"  # 120 rows
    over = _row_split(good, embed, 120)
    for _ in range(MAX_SHARDS_PER_TENSOR - 119):  # replicas of row 0: 257 shards in all
        replica = over.shards.add()
        replica.CopyFrom(next(s for s in over.shards if s.name == embed))
    assert str(MAX_SHARDS_PER_TENSOR) in assert_refused(receiver, over, Kind.LIMIT, INVALID)


def test_a_tensor_split_into_many_row_shards_is_tiled_and_copied(trainer) -> None:
    """The grid check accepts a legitimate 120-shard tiling and copies it exactly."""
    manifest = _row_split(trainer.publish(1), "model.embed_tokens.weight", 120)
    applied = dict(make_receiver().apply(manifest))
    name = "model.embed_tokens.weight"
    assert torch.equal(applied[name], trainer.params[name])


def _boxes(manifest, name: str, boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    """``name`` as the given (offset, shape) blocks, each over the tensor's own bytes start
    (the bytes do not matter: tiling is checked before storage is opened)."""
    out = copy_manifest(manifest)
    whole = shard_of(out, name)
    for offset, shape in boxes:
        piece = out.shards.add()
        piece.CopyFrom(whole)
        piece.local_offset[:] = offset
        piece.local_shape[:] = shape
        piece.stride[:] = contiguous_strides(shape)
        piece.storage.shm.nbytes = math.prod(shape) * 4
    out.shards.remove(whole)
    return out


@pytest.mark.parametrize(
    ("boxes", "problem"),
    [
        ([((0, 0), (64, 32)), ((0, 0), (64, 32))], "gap"),  # a replica, the rest missing
        ([((0, 0), (40, 64)), ((32, 0), (32, 64))], "overlap"),
        ([((0, 0), (30, 64)), ((32, 0), (32, 64))], "gap"),
        # Bricks: each element once, but not a grid (the rows' intervals overlap).
        ([((0, 0), (32, 32)), ((32, 0), (32, 32)), ((0, 32), (64, 32))], "overlap"),
        ([((0, 0), (32, 32)), ((32, 32), (32, 32))], "grid"),  # two of four cells
    ],
)
def test_shards_that_do_not_tile_a_tensor_once_are_refused(trainer, boxes, problem) -> None:
    manifest = _boxes(trainer.publish(1), "model.layers.0.self_attn.q_proj.weight", boxes)
    assert problem in assert_refused(make_receiver(), manifest, Kind.COVERAGE, INVALID)


# ---- numbers -------------------------------------------------------------------


def test_weights_that_are_not_finite_are_never_published(trainer) -> None:
    """Before this check: NaN weights went through the sync path. The publisher refuses them,
    naming the parameter, and nothing becomes pending."""
    trainer.params[NORM][3] = float("nan")
    with pytest.raises(PublishError, match=f"NaN or infinity .*{NORM}"):
        trainer.publish(1)
    assert trainer.publisher.pending_version is None
    trainer.params[NORM][3] = 0.0
    trainer.params["lm_head.weight"][0, 0] = float("-inf")
    with pytest.raises(PublishError, match=r"lm_head\.weight"):
        trainer.publish(1)
    trainer.params["lm_head.weight"][0, 0] = 1.0
    assert trainer.publish(1).shards


def test_non_finite_storage_is_never_copied(trainer) -> None:
    """The receiver checks what it reads, right before the copy: storage that holds NaN (or
    infinity) after it was published is refused, FAILED_PRECONDITION, and the buffers keep
    the version before."""
    receiver = make_receiver()
    receiver.apply(trainer.publish(1))
    trainer.publisher.finish(1)
    manifest = trainer.publish(2)
    staging = trainer.publisher._storage
    for bad in (float("nan"), float("inf")):
        view = next(v for v in staging.views if v.dim() == 2)
        kept = view[0, 0].item()
        view[0, 0] = bad
        assert "NaN or infinity" in assert_refused(
            receiver, manifest, Kind.NON_FINITE, PRECONDITION
        )
        view[0, 0] = kept
    assert receiver.apply(manifest).plan_cached
