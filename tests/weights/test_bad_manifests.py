"""Manifests that do not fit are refused with the right kind, and nothing changes."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch

from podrl.v1 import weights_pb2
from podrl.weights import (
    PublishError,
    WeightPublisher,
    WeightReceiver,
)
from tests.weights.manifest_cases import (
    DESCRIPTION,
    Kind,
    Trainer,
    assert_refused,
    copy_manifest,
    make_receiver,
)


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    trainer = Trainer(key=None)
    yield trainer
    trainer.publisher.close()


@pytest.fixture
def receiver() -> WeightReceiver:
    return make_receiver()


INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


def test_wrong_name_shape_dtype_missing_coverage(trainer, receiver) -> None:
    good = trainer.publish(1)
    bad = copy_manifest(good)
    bad.shards[0].name = "model.layers.0.self_attn.qkv.weight"
    assert_refused(receiver, bad, Kind.UNKNOWN_NAME, INVALID)

    bad = copy_manifest(good)
    bad.shards[1].global_shape[0] += 1
    assert_refused(receiver, bad, Kind.SHAPE, INVALID)

    bad = copy_manifest(good)
    bad.shards[2].dtype = weights_pb2.DTYPE_INT8
    assert_refused(receiver, bad, Kind.DTYPE, INVALID)

    bad = copy_manifest(good)
    bad.shards[2].dtype = weights_pb2.DTYPE_UNSPECIFIED
    assert_refused(receiver, bad, Kind.DTYPE, INVALID)

    bad = copy_manifest(good)
    del bad.shards[3]
    assert_refused(receiver, bad, Kind.MISSING_NAME, INVALID)

    # A block half the size: consistent bytes, but the tensor is not covered.
    bad = copy_manifest(good)
    shard = next(s for s in bad.shards if len(s.local_shape) == 2)
    shard.local_shape[0] //= 2
    shard.storage.shm.nbytes //= 2
    assert_refused(receiver, bad, Kind.COVERAGE, INVALID)

    bad = copy_manifest(good)
    bad.shards[0].storage.shm.nbytes += 4
    assert_refused(receiver, bad, Kind.SHAPE, INVALID)

    bad = copy_manifest(good)
    bad.publisher_id = "someone-else"
    assert_refused(receiver, bad, Kind.UNTRUSTED, PRECONDITION)

    # The good one still applies after all that.
    applied = dict(receiver.apply(good))
    assert torch.equal(applied["lm_head.weight"], trainer.params["lm_head.weight"])


def test_the_receiver_copies_any_version_it_holds_storage_for(trainer, receiver) -> None:
    """Version order is the generator's weight state's to check (tests/generator/
    test_weight_state.py), in one place; the receiver copies what a manifest names."""
    receiver.apply(trainer.publish(3))
    trainer.publisher.finish(3)
    trainer.params["lm_head.weight"].add_(1.0)
    older = receiver.apply(trainer.publish(2, force_full=True))
    assert older.version == 2 and older.plan_cached
    assert torch.equal(dict(older)["lm_head.weight"], trainer.params["lm_head.weight"])


def test_fingerprint_change_needs_full_manifest(trainer, receiver) -> None:
    first = trainer.publish(1)
    receiver.apply(first)
    trainer.publisher.finish(1)

    # A version-only manifest naming storage the receiver never mapped is refused.
    forged = weights_pb2.WeightManifest(
        version=2, model_fingerprint="0" * 64, version_only=True, publisher_id="trainer-0"
    )
    assert_refused(receiver, forged, Kind.FINGERPRINT, PRECONDITION)
    # So is one sent to a receiver that has no plan yet.
    fresh = WeightReceiver(DESCRIPTION)
    assert_refused(fresh, trainer.publish(2), Kind.FINGERPRINT, PRECONDITION)
    trainer.publisher.finish(2)

    # New storage (e.g. a checkpoint loaded into new tensors): the publisher sends a full
    # manifest with a new fingerprint by itself, and the receiver re-plans.
    trainer.params["model.norm.weight"] = torch.full_like(trainer.params["model.norm.weight"], 7)
    third = trainer.publish(3)
    assert not third.version_only
    assert third.model_fingerprint != first.model_fingerprint
    applied = receiver.apply(third)
    assert not applied.plan_cached
    assert torch.equal(dict(applied)["model.norm.weight"], trainer.params["model.norm.weight"])


def test_publisher_waits_for_acknowledgement(trainer) -> None:
    trainer.publish(1)
    with pytest.raises(PublishError):
        trainer.publish(2)
    trainer.publish(1, force_full=True)  # republishing the pending version is fine
    trainer.publisher.finish(1)
    assert trainer.publish(2).version_only


def test_live_staging_needs_cuda_parameters(trainer) -> None:
    """staging='live' exports the live parameters by CUDA IPC; CPU weights go through 'shm'."""
    live = WeightPublisher(lambda: trainer.params, staging="live")
    with pytest.raises(PublishError, match="staging='live' needs CUDA parameters"):
        live.start(1)
    live.close()
    with pytest.raises(ValueError, match="'auto', 'shm' or 'live'"):
        WeightPublisher(lambda: trainer.params, staging="direct")
