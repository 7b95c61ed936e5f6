"""The two interfaces' phases (podrl.weights.protocol, docs/weights.md "Lifecycle"): start,
update and finish on both sides, in order, and what a refused start leaves."""

from __future__ import annotations

import pytest
import torch

from podrl.weights import (
    ManifestAssembler,
    ManifestError,
    Publisher,
    PublishError,
    Receiver,
    WeightPublisher,
)
from tests.weights.manifest_cases import DESCRIPTION, KEY, NORM, Kind, make_receiver


def _params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {name: torch.randn(shape) for name, shape in DESCRIPTION.params.items()}


def test_one_update_phase_by_phase_on_both_sides() -> None:
    params = _params()
    publisher: Publisher = WeightPublisher(
        lambda: params, assembler=ManifestAssembler("trainer-0", KEY)
    )
    receiver: Receiver = make_receiver(key=KEY)
    destinations = {name: torch.zeros(shape) for name, shape in DESCRIPTION.params.items()}
    try:
        part = publisher.start(1)
        assert publisher.pending_version == 1
        manifest = publisher.update(1, [part])
        assert not manifest.version_only and manifest.mac

        receiver.start(manifest, destinations)
        assert not destinations[NORM].any()  # start writes nothing
        receiver.update()
        copied = receiver.finish()
        assert copied.version == 1 and not copied.plan_cached
        assert all(torch.equal(t, params[n]) for n, t in copied)

        publisher.finish(1)
        assert publisher.pending_version is None
        params[NORM].add_(1.0)  # the storage may change again: version 2 is version-only
        version_only = publisher.update(2, [publisher.start(2)])
        assert version_only.version_only
        assert receiver.apply(version_only, destinations).plan_cached
        assert torch.equal(destinations[NORM], params[NORM])
    finally:
        publisher.close()
        receiver.close()


def test_a_refused_start_leaves_nothing_to_update() -> None:
    params = _params()
    publisher = WeightPublisher(lambda: params, assembler=ManifestAssembler("trainer-0", KEY))
    receiver = make_receiver(key=KEY)
    destinations = {name: torch.zeros(shape) for name, shape in DESCRIPTION.params.items()}
    try:
        receiver.start(publisher.update(1, [publisher.start(1)]), destinations)
        forged = publisher.update(1, [publisher.start(1)])
        forged.version = 9  # the MAC no longer matches
        with pytest.raises(ManifestError) as refused:
            receiver.start(forged, destinations)
        assert refused.value.kind is Kind.UNAUTHENTIC
        # The manifest started before the refusal is not copied by a later update.
        with pytest.raises(RuntimeError, match="without a started manifest"):
            receiver.update()
        assert not destinations[NORM].any()
    finally:
        publisher.close()
        receiver.close()


def test_the_phases_keep_their_order() -> None:
    params = _params()
    publisher = WeightPublisher(lambda: params, assembler=ManifestAssembler("trainer-0", KEY))
    receiver = make_receiver(key=KEY)
    try:
        manifest = publisher.update(1, [publisher.start(1)])
        with pytest.raises(RuntimeError, match="without a started manifest"):
            receiver.finish()
        receiver.start(manifest)
        with pytest.raises(RuntimeError, match="finish before update"):
            receiver.finish()
        receiver.update()
        assert receiver.finish().version == 1
    finally:
        publisher.close()
        receiver.close()


def test_only_the_rank_with_the_assembler_updates() -> None:
    params = _params()
    other_rank = WeightPublisher(lambda: params, rank=1)
    try:
        part = other_rank.start(1)
        with pytest.raises(PublishError, match="only rank 0 assembles"):
            other_rank.update(1, [part])
    finally:
        other_rank.close()
