"""A multi-turn episode trains with a per-token mask (TrainSequence.completion_mask): its
environment replies (mask 0) change no gradient, count in no total and are compared with no
generator logprob. Hand values from the formulas in docs/algorithms.md; no model."""

from __future__ import annotations

import math

import pytest
import torch

from podrl.algorithms.losses import LossSettings, policy_loss
from podrl.controller.step.batch import TrainBatch, train_request
from podrl.trainer.batch import (
    BatchError,
    BatchLimits,
    batch_totals,
    check_share_counts,
    collate,
    validate_train_request,
)
from podrl.v1 import trainer_pb2

LIMITS = BatchLimits(vocab_size=100, max_positions=64)

# Prompt [1, 2]; completion: a sampled token, an environment reply token, a sampled token.
TRAINER = [-1.0, -2.0, -0.5]
GENERATOR = [-1.0, 0.0, -0.7]  # the reply's entry is the episode's 0.0, never read


def _episode(mask: list[int] | None = (1, 0, 1), advantage: float = 1.0):
    return trainer_pb2.TrainSequence(
        sample_id="episode",
        prompt_ids=[1, 2],
        completion_ids=[5, 6, 7],
        generator_logprobs=GENERATOR,
        completion_mask=list(mask or ()),
        advantage=advantage,
    )


def _request(*sequences: trainer_pb2.TrainSequence) -> trainer_pb2.TrainRequest:
    return trainer_pb2.TrainRequest(sequences=sequences, policy_version=0)


def test_collate_puts_the_mask_on_the_completion_positions() -> None:
    batch = collate([_episode(), _episode(mask=None)], pad_id=0)
    # Logits at positions 1..3 predict the three completion tokens.
    assert batch.loss_mask.tolist() == [[0, 1, 0, 1], [0, 1, 1, 1]]


def test_a_masked_token_changes_no_gradient_and_counts_in_no_mean() -> None:
    batch = collate([_episode()], pad_id=0)
    logprobs = torch.tensor([[0.0, *TRAINER]], requires_grad=True)
    settings = LossSettings(mode="grpo", clip_eps_low=0.2, clip_eps_high=0.2)
    totals = batch_totals([_episode()])
    assert (totals.num_sequences, totals.num_tokens) == (1, 2)
    terms = policy_loss(
        logprobs, batch.generator_logprobs, batch.advantages, batch.loss_mask, settings, totals
    )
    terms.loss.backward()
    # Token 1: r = 1 → -1. Token 3: r = e^0.2 = 1.221 > 1.2 → clipped, -1.2. Mean of the two
    # trained tokens; the reply (r would be e^-2) is in neither the sum nor the count.
    assert terms.loss.item() == pytest.approx(-(1.0 + 1.2) / 2, abs=1e-6)
    assert terms.tokens.item() == 2
    assert terms.ratio_sum.item() == pytest.approx(1.0 + math.exp(0.2), abs=1e-6)
    # k3 of the behaviour against the trainer on the sampled tokens only.
    k3 = math.exp(0.2) - 0.2 - 1.0  # delta = trainer - generator = 0.2 on token 3
    assert terms.mismatch_kl_sum.item() == pytest.approx(k3, abs=1e-6)
    assert logprobs.grad is not None
    # d/dlogp of -r A / 2 is -1/2 on token 1; the reply and the clipped token get none.
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5, 0.0, 0.0], abs=1e-6)


def test_the_reply_token_does_not_move_the_loss() -> None:
    """The reply's trainer logprob changes, the loss and the gradients do not."""
    settings = LossSettings(mode="dapo")

    def loss(reply_logprob: float) -> float:
        batch = collate([_episode()], pad_id=0)
        logprobs = torch.tensor([[0.0, TRAINER[0], reply_logprob, TRAINER[2]]])
        totals = batch_totals([_episode()])
        return policy_loss(
            logprobs, batch.generator_logprobs, batch.advantages, batch.loss_mask, settings, totals
        ).loss.item()

    assert loss(-2.0) == loss(-9.0) == loss(-0.01)


def test_totals_count_trained_tokens_on_both_sides() -> None:
    episode, plain = _episode(), _episode(mask=None)
    assert batch_totals([episode, plain]).num_tokens == 2 + 3
    batch = TrainBatch(sequences=[episode, plain], stats={})
    sent = train_request([episode, plain], batch, policy_version=0, batch_id="b", pods=1)
    assert sent.global_completion_tokens == 5
    check_share_counts(sent)  # one pod: its share's own trained tokens


@pytest.mark.parametrize(
    ("mask", "says"),
    [
        ([1, 0], "2 values for 3 completion tokens"),
        ([1, 2, 1], "0 or 1"),
        ([0, 0, 0], "at least one 1"),
    ],
)
def test_a_bad_mask_is_refused_naming_the_field(mask: list[int], says: str) -> None:
    with pytest.raises(BatchError, match=r"sequences\[0\]\.completion_mask") as err:
        validate_train_request(_request(_episode(mask=mask)), 0, LIMITS)
    assert says in str(err.value)
    validate_train_request(_request(_episode()), 0, LIMITS)
