"""Checking a Train request before it reaches the model, and cutting it into micro-batches.

Validation runs on rank 0 before the batch is broadcast, so a bad batch never touches the model
or the optimizer on any rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from podrl.algorithms.losses import BatchTotals
from podrl.v1 import trainer_pb2


class BatchError(ValueError):
    """The Train request cannot be trained on; the message names the field (→ INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class BatchLimits:
    vocab_size: int
    max_positions: int


def validate_train_request(
    request: trainer_pb2.TrainRequest, policy_version: int, limits: BatchLimits
) -> None:
    """Raise BatchError naming the first problem; return quietly if the batch is trainable."""
    if request.policy_version != policy_version:
        raise BatchError(
            f"policy_version: the trainer holds version {policy_version}, the request expects "
            f"{request.policy_version}; send batches for the current version"
        )
    if not request.sequences:
        raise BatchError("sequences: the batch is empty")
    problems: list[str] = []
    for i, seq in enumerate(request.sequences):
        where = f"sequences[{i}]"
        if not seq.prompt_ids:
            problems.append(f"{where}.prompt_ids: empty (the first completion token needs context)")
        if not seq.completion_ids:
            problems.append(f"{where}.completion_ids: empty completion")
        if len(seq.generator_logprobs) != len(seq.completion_ids):
            problems.append(
                f"{where}.generator_logprobs: {len(seq.generator_logprobs)} values for "
                f"{len(seq.completion_ids)} completion tokens; send one logprob per token"
            )
        bad = [x for x in seq.generator_logprobs if not math.isfinite(x) or x > 1e-4]
        if bad:
            problems.append(
                f"{where}.generator_logprobs: {len(bad)} value(s) not a finite log-probability "
                f"<= 0 (e.g. {bad[0]})"
            )
        if not math.isfinite(seq.advantage):
            problems.append(f"{where}.advantage: {seq.advantage} is not finite")
        if seq.policy_version > policy_version:
            problems.append(
                f"{where}.policy_version: {seq.policy_version} is newer than the trainer's "
                f"{policy_version}"
            )
        total = len(seq.prompt_ids) + len(seq.completion_ids)
        if total > limits.max_positions:
            problems.append(
                f"{where}: {total} tokens exceed the model's {limits.max_positions} positions"
            )
        ids = [*seq.prompt_ids, *seq.completion_ids]
        if ids and (min(ids) < 0 or max(ids) >= limits.vocab_size):
            problems.append(f"{where}: token ids must lie in [0, {limits.vocab_size})")
        if len(problems) >= 5:
            break
    if problems:
        raise BatchError("; ".join(problems))


def batch_totals(sequences: Sequence[trainer_pb2.TrainSequence]) -> BatchTotals:
    return BatchTotals(
        num_sequences=len(sequences),
        num_tokens=sum(len(s.completion_ids) for s in sequences),
    )


@dataclass
class MicroBatch:
    """Right-padded tensors of a few sequences. Position j of the ``[B, L-1]`` tensors holds the
    prediction of token j+1 from the logits at position j."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    targets: torch.Tensor  # [B, L-1]
    loss_mask: torch.Tensor  # [B, L-1], 1 on completion tokens
    generator_logprobs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B]

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(**{name: t.to(device) for name, t in vars(self).items()})


def collate(sequences: Sequence[trainer_pb2.TrainSequence], pad_id: int) -> MicroBatch:
    """Tensors of ``sequences``; an empty list gives one all-masked dummy row (a rank with no
    data still runs forward/backward so FSDP's collectives line up)."""
    if not sequences:
        ids = torch.full((1, 2), pad_id, dtype=torch.long)
        zeros = torch.zeros((1, 1))
        return MicroBatch(
            ids, torch.ones_like(ids), ids[:, 1:], zeros, zeros.clone(), torch.zeros(1)
        )
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in sequences)
    rows = len(sequences)
    input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((rows, length), dtype=torch.long)
    loss_mask = torch.zeros((rows, length - 1))
    generator_logprobs = torch.zeros((rows, length - 1))
    for row, seq in enumerate(sequences):
        prompt, completion = len(seq.prompt_ids), len(seq.completion_ids)
        input_ids[row, : prompt + completion] = torch.tensor(
            [*seq.prompt_ids, *seq.completion_ids], dtype=torch.long
        )
        attention_mask[row, : prompt + completion] = 1
        loss_mask[row, prompt - 1 : prompt - 1 + completion] = 1
        generator_logprobs[row, prompt - 1 : prompt - 1 + completion] = torch.tensor(
            list(seq.generator_logprobs)
        )
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32)
    return MicroBatch(
        input_ids, attention_mask, input_ids[:, 1:], loss_mask, generator_logprobs, advantages
    )


def split_for_rank(
    sequences: Sequence[trainer_pb2.TrainSequence],
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
) -> list[list[trainer_pb2.TrainSequence]]:
    """This data-parallel rank's micro-batches. Every rank gets the same number of micro-batches
    (some possibly empty) because each forward/backward is a collective under FSDP."""
    per_rank = math.ceil(len(sequences) / dp_size)
    mine = list(sequences[dp_rank * per_rank : (dp_rank + 1) * per_rank])
    count = max(1, math.ceil(per_rank / micro_batch_size))
    return [mine[i * micro_batch_size : (i + 1) * micro_batch_size] for i in range(count)]
