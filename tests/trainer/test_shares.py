"""Units without processes: a pod's share of a batch (its checks, ``validate_share``, and the
loss's denominators, ``share_totals``: ``podrl.trainer.batch``) and how a healing pod takes a
peer's state (``_copy_into``: ``podrl.trainer.replication``)."""

from __future__ import annotations

import pytest
import torch

from podrl.trainer.batch import (
    BatchError,
    BatchLimits,
    check_share_counts,
    share_totals,
    validate_share,
)
from podrl.trainer.replication import ReplicaStateError, _copy_into
from tests.trainer.pods import share
from tests.trainer.rank_worker import make_request

LIMITS = BatchLimits(vocab_size=128, max_positions=64)


def test_a_whole_batch_divides_by_its_own_counts_and_a_share_by_the_batch():
    batch = make_request(1, sequences=6)
    tokens = sum(len(s.completion_ids) for s in batch.sequences)
    assert share_totals(batch) == (totals := share_totals(share(batch, range(6), "x", 1)))
    assert (totals.num_sequences, totals.num_tokens) == (6, tokens)
    part = share(batch, range(2), "x", 2)
    assert (share_totals(part).num_sequences, share_totals(part).num_tokens) == (6, tokens)


def test_shares_pass_on_a_replicated_trainer_an_empty_one_included():
    batch = make_request(1, sequences=6)
    validate_share(share(batch, range(2), "a", 2), 0, LIMITS, replicated=True)
    validate_share(share(batch, [], "b", 2), 0, LIMITS, replicated=True)
    with pytest.raises(BatchError, match="policy_version: the trainer holds version 3"):
        validate_share(share(batch, [], "b", 2), 3, LIMITS, replicated=True)


def test_a_trainer_without_replication_takes_only_whole_batches():
    batch = make_request(1, sequences=6)
    validate_share(batch, 0, LIMITS, replicated=False)
    validate_share(share(batch, range(6), "x", 1), 0, LIMITS, replicated=False)
    with pytest.raises(BatchError, match=r"^global_sequences: the batch has 6 sequences"):
        validate_share(share(batch, range(2), "x", 1), 0, LIMITS, replicated=False)
    with pytest.raises(BatchError, match=r"^pods: 2 pods train this step"):
        validate_share(share(batch, range(6), "x", 2), 0, LIMITS, replicated=False)
    empty = share(batch, [], "x", 1)
    with pytest.raises(BatchError, match="global_sequences"):
        validate_share(empty, 0, LIMITS, replicated=False)


def test_inconsistent_totals_name_the_fields():
    batch = make_request(1, sequences=6)
    half = share(batch, range(3), "x", 2)
    half.global_completion_tokens = 0
    with pytest.raises(BatchError, match="set both"):
        validate_share(half, 0, LIMITS, replicated=True)
    more = share(batch, range(3), "x", 2)
    more.global_sequences = 2
    with pytest.raises(BatchError, match="more than the whole batch's 2"):
        validate_share(more, 0, LIMITS, replicated=True)
    # The per-sequence checks still run on a share.
    bad = share(batch, range(3), "x", 2)
    bad.sequences[0].advantage = float("nan")
    with pytest.raises(BatchError, match=r"sequences\[0\].advantage"):
        validate_share(bad, 0, LIMITS, replicated=True)


def test_a_share_that_contradicts_its_totals_is_refused_before_any_quorum():
    batch = make_request(1, sequences=3)
    tokens = sum(len(s.completion_ids) for s in batch.sequences)
    one_pod = share(batch, range(3), "x", 1)
    check_share_counts(one_pod)  # one pod: the share is the whole batch
    one_pod.global_completion_tokens = 999
    with pytest.raises(BatchError, match=r"^global_completion_tokens: one pod trains this step"):
        check_share_counts(one_pod)
    with pytest.raises(BatchError, match=r"^global_completion_tokens: one pod"):
        validate_share(one_pod, 0, LIMITS, replicated=True)
    more = share(batch, range(3), "x", 2)
    more.global_completion_tokens = tokens - 1
    with pytest.raises(BatchError, match="more than the whole batch's"):
        check_share_counts(more)
    part = share(batch, range(2), "x", 2)  # a share of two pods may hold less than the totals
    check_share_counts(part)
    check_share_counts(batch)  # no totals: the request is the whole batch


def test_a_peer_state_is_copied_into_the_own_tensors_or_refused_by_name():
    weight = torch.zeros(2, 3)
    mine = {"model": {"w": weight}, "optim": {"param_groups": [{"lr": 0.0}]}}
    theirs = {"model": {"w": torch.ones(2, 3)}, "optim": {"param_groups": [{"lr": 0.5}]}}
    filled = _copy_into(mine, theirs)
    assert filled["model"]["w"] is weight and bool((weight == 1).all())  # in place
    assert filled["optim"]["param_groups"][0]["lr"] == 0.5  # other leaves: the peer's
    other_shape = {"model": {"w": torch.ones(3, 2)}, "optim": theirs["optim"]}
    with pytest.raises(ReplicaStateError, match=r"\['model'\]\['w'\]: .* shape \(3, 2\)"):
        _copy_into(mine, other_shape)
    other_name = {"model": {"v": torch.ones(2, 3)}, "optim": theirs["optim"]}
    with pytest.raises(ReplicaStateError, match=r"has no \['model'\]\['w'\]"):
        _copy_into(mine, other_name)
    with pytest.raises(ReplicaStateError, match="has 1 entries, this trainer's 2"):
        _copy_into(mine, {"model": {}, "optim": theirs["optim"]})
