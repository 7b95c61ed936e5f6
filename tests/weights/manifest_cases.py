"""Manifests of a one-process trainer over a tiny Qwen3, and the check that a receiver refused
one with the right kind and left its buffers alone: shared by the hostile-manifest tests."""

from __future__ import annotations

import os

import grpc
import pytest
import torch

from podrl.v1 import weights_pb2
from podrl.weights import (
    ManifestAssembler,
    ManifestError,
    ManifestErrorKind,
    ModelDescription,
    WeightPublisher,
    WeightReceiver,
)
from podrl.weights.protocol import WeightsKey
from tests.harness.weights import publish_single_process
from tests.weights.tiny_qwen3 import CONFIG

Kind = ManifestErrorKind
DESCRIPTION = ModelDescription.from_hf_config(CONFIG)
KEY = WeightsKey(b"k" * 32, os.geteuid())
NORM = "model.norm.weight"


class Trainer:
    def __init__(self, key: WeightsKey | None = KEY) -> None:
        torch.manual_seed(0)
        self.params = {n: torch.randn(s) for n, s in DESCRIPTION.params.items()}
        self.publisher = WeightPublisher(lambda: self.params)
        self.assembler = ManifestAssembler("trainer-0", key)

    def publish(self, version: int, **kwargs: object) -> weights_pb2.WeightManifest:
        return publish_single_process(self.publisher, self.assembler, version, **kwargs)


def make_receiver(**kwargs: object) -> WeightReceiver:
    return WeightReceiver(DESCRIPTION, trusted_publisher_id="trainer-0", **kwargs)


def copy_manifest(manifest: weights_pb2.WeightManifest) -> weights_pb2.WeightManifest:
    return weights_pb2.WeightManifest.FromString(manifest.SerializeToString())


def assert_refused(receiver: WeightReceiver, manifest, kind: Kind, code: grpc.StatusCode) -> str:
    """The manifest is refused with ``kind``/``code``; the receiver's fingerprint and buffers
    are unchanged."""
    before_fingerprint = receiver.fingerprint
    before = (
        {n: t.clone() for n, t in receiver._cached.destinations.items()} if receiver._cached else {}
    )
    with pytest.raises(ManifestError) as error:
        receiver.apply(manifest)
    assert error.value.kind is kind, error.value
    assert error.value.status_code == code
    assert receiver.fingerprint == before_fingerprint
    for name, tensor in before.items():
        assert torch.equal(receiver._cached.destinations[name], tensor), name
    return str(error.value)


def shard_of(manifest: weights_pb2.WeightManifest, name: str) -> weights_pb2.TensorShard:
    return next(s for s in manifest.shards if s.name == name)


INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
DENIED = grpc.StatusCode.PERMISSION_DENIED
