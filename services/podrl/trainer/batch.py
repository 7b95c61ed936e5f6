"""A Train batch from the request to the loss's inputs: checks, micro-batches, attention and
per-token logprobs.

**Checks and micro-batches.** A Train request is checked before it reaches the model, then cut
into micro-batches. Validation runs on rank 0 before the batch is broadcast, so a bad batch
never touches the model or the optimizer on any rank. A request may be one pod's share of a
batch split over pods (``trainer.replication``): its checks and the whole batch's totals (the
loss's denominators) are here too, so an unreplicated step never reaches
``podrl.trainer.replication``.

**Packed attention** (``trainer.packing``, ``trainer.attn_implementation: sdpa``): attention for
packed and right-padded micro-batches, with no attention mask. GRPO samples have very different
lengths. Padded to the longest, a micro-batch computes every layer on padding; packed (all
sequences of the micro-batch one after another in a single row, positions restarting at 0 for
each), it computes only real tokens. Attention must then stay inside each sequence: a
block-diagonal causal pattern given by the cumulative sequence lengths ``cu_seqlens`` (``[0,
n_0, n_0 + n_1, ...]``).

``podrl_attention`` is registered with transformers' ``AttentionInterface`` as
:data:`ATTENTION_NAME`; models load with it when ``trainer.attn_implementation`` is ``sdpa``.
transformers builds no mask for a registered custom attention (no ``[B, 1, L, L]`` tensor, no
host synchronisation checking whether the mask is all ones), so:

* packed rows (``packed_cu_seqlens`` passed through the model's keyword arguments): on CUDA in
  bf16/fp16, flash attention's variable-length kernel (``aten::_flash_attention_forward`` with
  cumulative lengths, which has its own backward and supports grouped KV heads); elsewhere, one
  causal SDPA call per distinct sequence length (the sequences of a length as rows);
* rows without ``packed_cu_seqlens``: causal SDPA over each row. This is exact for
  right-padded rows: a real token never attends to a later position, so it never sees the
  padding after it (the padding's own outputs are never used).

**Per-token logprobs** (``trainer.fused_logprobs``) of the sampled tokens without materialising
full-vocabulary fp32 logits. The policy loss needs, for each completion token, ``log softmax(h @
W.T / T)[target]`` (plus the entropy of that distribution as a metric). Computed the plain way,
a micro-batch of N tokens holds an ``[N, V]`` bf16 logits tensor, its fp32 copy, the fp32
log-softmax and, in backward, fp32 gradients of each: with Qwen3's 151,936-token vocabulary that
is ~2.4 GB per 1,000 tokens.

:class:`FusedLinearLogprobs` computes the vocabulary projection, log-softmax, gather and entropy
in chunks of ``chunk_tokens`` tokens with its own backward: forward keeps one logsumexp per
token; backward recomputes each chunk's logits (one extra matmul) and forms
``dlogits = g * (onehot(target) - softmax) / T`` chunk by chunk. Only ``[chunk, V]`` tensors ever
exist. The logits are rounded to the hidden states' dtype before the fp32 softmax, exactly as
``lm_head(h).float()`` does, so in fp32 the result equals the plain path (``plain_logprobs``).

:class:`LogprobHead` puts this inside the model's own forward: the model's ``lm_head`` (an
``nn.Linear``) becomes a ``LogprobHead`` (same parameter, same state-dict key) that returns
per-token logprobs while a :class:`HeadRequest` is set (:func:`request_logprobs`) and plain
logits otherwise. Running inside ``model(...)`` matters under FSDP2: the head's weight is
unsharded only during the root module's forward. Only the requested token positions (the
completion tokens) go through the vocabulary projection; prompt positions never do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from podrl.algorithms.losses import BatchTotals
from podrl.v1 import trainer_pb2

ATTENTION_NAME = "podrl_sdpa"

# The keyword arguments a packed forward passes to ``model(...)``; transformers hands them on to
# every attention call.
CU_SEQLENS_KWARG = "packed_cu_seqlens"
MAX_SEQLEN_KWARG = "packed_max_seqlen"

MAX_ABS_ADVANTAGE = 1e4
"""Largest |advantage| a Train accepts. Group-relative advantages are a few units (rewards minus
the group mean, std-normalised or not); 3e38 is finite, yet it turned every weight into NaN."""
MIN_GENERATOR_LOGPROB = -1e4
"""Smallest generator logprob a Train accepts: a sampled token's log-probability is never
near it, and the importance ratio exp(new - old) of a smaller one overflows."""


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
        bad = [
            x
            for x in seq.generator_logprobs
            if not math.isfinite(x) or x > 1e-4 or x < MIN_GENERATOR_LOGPROB
        ]
        if bad:
            problems.append(
                f"{where}.generator_logprobs: {len(bad)} value(s) not a finite log-probability "
                f"in [{MIN_GENERATOR_LOGPROB:g}, 0] (e.g. {bad[0]})"
            )
        if seq.completion_mask:
            if len(seq.completion_mask) != len(seq.completion_ids):
                problems.append(
                    f"{where}.completion_mask: {len(seq.completion_mask)} values for "
                    f"{len(seq.completion_ids)} completion tokens; send one 0/1 per token, or "
                    "none to train every token"
                )
            elif any(m > 1 for m in seq.completion_mask) or not any(seq.completion_mask):
                problems.append(
                    f"{where}.completion_mask: values must be 0 or 1 with at least one 1 (a "
                    "sequence with no trained token trains nothing)"
                )
        if not math.isfinite(seq.advantage):
            problems.append(f"{where}.advantage: {seq.advantage} is not finite")
        elif abs(seq.advantage) > MAX_ABS_ADVANTAGE:
            problems.append(
                f"{where}.advantage: {seq.advantage:g} lies outside ±{MAX_ABS_ADVANTAGE:g}; "
                "group-relative advantages are a few units (check the rewards)"
            )
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


def trained_tokens(seq: trainer_pb2.TrainSequence) -> int:
    """The completion tokens a sequence trains: its mask's ones, or all without a mask."""
    return sum(seq.completion_mask) if seq.completion_mask else len(seq.completion_ids)


def batch_totals(sequences: Sequence[trainer_pb2.TrainSequence]) -> BatchTotals:
    """The batch's denominators; tokens are trained tokens (an episode's environment replies
    count in no mean)."""
    return BatchTotals(
        num_sequences=len(sequences),
        num_tokens=sum(trained_tokens(s) for s in sequences),
    )


# -- a pod's share of a batch (docs/scaling.md, "Trainers across pods") -------------------


def is_share(request: trainer_pb2.TrainRequest) -> bool:
    """True if the request carries batch-wide totals (it may be a part of a larger batch)."""
    return bool(request.global_sequences or request.global_completion_tokens)


def share_totals(request: trainer_pb2.TrainRequest) -> BatchTotals:
    """The loss's denominators: the whole batch's counts (the request's own when it is the
    whole batch)."""
    if is_share(request):
        return BatchTotals(
            num_sequences=int(request.global_sequences),
            num_tokens=int(request.global_completion_tokens),
        )
    return batch_totals(request.sequences)


def check_share_counts(request: trainer_pb2.TrainRequest) -> None:
    """The checks of a share's counts that need no peer and no version (BatchError naming the
    field): both totals or neither; a share holds no more than the totals; with one pod
    (``pods`` 1) the share is the whole batch. Run before the quorum, so a batch that
    contradicts itself is refused at once instead of waiting for pods that cannot exist."""
    if not is_share(request):
        return
    local_sequences = len(request.sequences)
    local_tokens = sum(trained_tokens(s) for s in request.sequences)
    if not request.global_sequences or not request.global_completion_tokens:
        raise BatchError(
            "global_sequences, global_completion_tokens: set both (the whole batch's counts) "
            "or neither (this request is the whole batch)"
        )
    if local_sequences > request.global_sequences or local_tokens > (
        request.global_completion_tokens
    ):
        raise BatchError(
            f"global_sequences: this share holds {local_sequences} sequences and "
            f"{local_tokens} completion tokens, more than the whole batch's "
            f"{request.global_sequences} and {request.global_completion_tokens}"
        )
    if request.pods == 1 and (
        request.global_sequences != local_sequences
        or request.global_completion_tokens != local_tokens
    ):
        raise BatchError(
            f"global_completion_tokens: one pod trains this step (pods 1), so its share is the "
            f"whole batch, but the request holds {local_sequences} sequences and {local_tokens} "
            f"completion tokens and names {request.global_sequences} and "
            f"{request.global_completion_tokens}; send the share's own counts, or 0 for both"
        )


def validate_share(
    request: trainer_pb2.TrainRequest,
    policy_version: int,
    limits: BatchLimits,
    replicated: bool,
) -> None:
    """``validate_train_request`` plus the fields of a batch split over pods; raise BatchError
    naming the field. Without cross-pod replication a request must be the whole batch."""
    local_sequences = len(request.sequences)
    local_tokens = sum(trained_tokens(s) for s in request.sequences)
    if not replicated:
        if request.pods > 1:
            raise BatchError(
                f"pods: {request.pods} pods train this step but this trainer has no cross-pod "
                "replication (trainer.replication.lighthouse_address is empty); send it the "
                "whole batch with pods 0 or 1, or set the Lighthouse address"
            )
        if is_share(request) and (
            request.global_sequences != local_sequences
            or request.global_completion_tokens != local_tokens
        ):
            raise BatchError(
                f"global_sequences: the batch has {request.global_sequences} sequences "
                f"({request.global_completion_tokens} completion tokens), this request holds "
                f"{local_sequences} ({local_tokens}), but this trainer has no cross-pod "
                "replication (trainer.replication.lighthouse_address is empty) and would step on "
                "its share alone; send the whole batch, or set the Lighthouse address"
            )
    check_share_counts(request)
    if is_share(request) and not request.sequences:
        # An empty share takes part in the step; only its version can be wrong.
        if request.policy_version != policy_version:
            raise BatchError(
                f"policy_version: the trainer holds version {policy_version}, the request "
                f"expects {request.policy_version}; send batches for the current version"
            )
        return
    validate_train_request(request, policy_version, limits)


@dataclass
class MicroBatch:
    """The model inputs of a few sequences and their loss tensors.

    The loss tensors are ``[B, L-1]`` (one row per sequence, right-padded to the longest):
    position j of row b is the prediction of token j+1 of sequence b from position j. The model
    inputs are either the same right-padded rows (``input_ids`` ``[B, L]``) or, packed, one row
    of all sequences back to back (``input_ids`` ``[1, T]``, T = total tokens, with
    ``position_ids`` restarting at 0 for each sequence and ``cu_seqlens`` marking where each
    starts). Either way only the completion positions need a logprob: ``token_index`` lists
    them as flat positions of the model's ``[rows * length]`` outputs, ``token_targets`` the
    tokens they predict, and ``gather_index`` places them back into the ``[B, L-1]`` layout
    (0 = no logprob needed there, k + 1 = the k-th listed position; see :meth:`to_rows`).
    """

    input_ids: torch.Tensor  # [B, L] rows, or [1, T] packed
    attention_mask: torch.Tensor | None  # [B, L]; None when the attention needs no mask
    position_ids: torch.Tensor | None  # [1, T] packed; None for rows (0..L-1)
    cu_seqlens: torch.Tensor | None  # [B + 1] int32 packed: cumulative sequence lengths
    max_seqlen: int  # the longest sequence (packed attention kernels need it)
    token_index: torch.Tensor  # [M] flat positions whose logprob the loss needs
    token_targets: torch.Tensor  # [M] the token each of them predicts
    gather_index: torch.Tensor  # [B, L-1] 0 or 1 + index into token_index
    loss_mask: torch.Tensor  # [B, L-1], 1 on completion tokens
    generator_logprobs: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B]

    def to(self, device: torch.device) -> MicroBatch:
        moved = {
            name: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for name, value in vars(self).items()
        }
        return MicroBatch(**moved)

    def model_inputs(self) -> dict[str, object]:
        """Keyword arguments of ``model(...)`` for this batch."""
        inputs: dict[str, object] = {"input_ids": self.input_ids}
        if self.attention_mask is not None:
            inputs["attention_mask"] = self.attention_mask
        if self.position_ids is not None:
            inputs["position_ids"] = self.position_ids
        if self.cu_seqlens is not None:
            inputs[CU_SEQLENS_KWARG] = self.cu_seqlens
            inputs[MAX_SEQLEN_KWARG] = self.max_seqlen
        return inputs

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[M]`` values of the ``token_index`` positions → ``[B, L-1]`` (0 where unused)."""
        return torch.cat([values.new_zeros(1), values])[self.gather_index]


def collate(
    sequences: Sequence[trainer_pb2.TrainSequence],
    pad_id: int,
    packed: bool = False,
    attention_mask: bool = True,
) -> MicroBatch:
    """Tensors of ``sequences``, packed into one row or right-padded (see :class:`MicroBatch`);
    ``packed`` applies only when the lengths differ (equal lengths stay rows: no padding).
    ``attention_mask=False`` leaves the padding mask out (attention that is causal by itself).
    An empty list gives one all-masked dummy row (a rank with no data still runs
    forward/backward so FSDP's collectives line up)."""
    if not sequences:
        ids = torch.full((1, 2), pad_id, dtype=torch.long)
        zeros = torch.zeros((1, 1))
        empty = torch.zeros(0, dtype=torch.long)
        return MicroBatch(
            input_ids=ids,
            attention_mask=torch.ones_like(ids) if attention_mask and not packed else None,
            position_ids=torch.arange(2).unsqueeze(0) if packed else None,
            cu_seqlens=torch.tensor([0, 2], dtype=torch.int32) if packed else None,
            max_seqlen=2,
            token_index=empty,
            token_targets=empty.clone(),
            gather_index=torch.zeros((1, 1), dtype=torch.long),
            loss_mask=zeros,
            generator_logprobs=zeros.clone(),
            advantages=torch.zeros(1),
        )
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in sequences]
    length, rows, total = max(lengths), len(sequences), sum(lengths)
    # Sequences of one length have no padding as rows, and rows run the faster fixed-length
    # attention kernels (on an H200, cuDNN's instead of flash varlen's).
    packed = packed and len(set(lengths)) > 1
    # Plain lists first, then one tensor per field: a tensor per sequence and field cost a
    # step of 128 short sequences several milliseconds of host time (docs/performance.md).
    starts = _starts(lengths) if packed else [row * length for row in range(rows)]
    ids: list[int] = []
    targets: list[int] = []  # the completion tokens, each predicted at a token_index position
    token_index: list[int] = []  # flat positions of the model's [rows * length] outputs
    loss_cells: list[int] = []  # flat positions of the [rows, length - 1] loss tensors
    loss_values: list[float] = []
    logprob_values: list[float] = []
    for row, seq in enumerate(sequences):
        prompt, completion = len(seq.prompt_ids), len(seq.completion_ids)
        ids += seq.prompt_ids
        ids += seq.completion_ids
        targets += seq.completion_ids
        start = starts[row]
        # Logits at positions prompt-1 .. prompt+completion-2 predict the completion tokens.
        first = prompt - 1
        token_index += range(start + first, start + first + completion)
        cell = row * (length - 1) + first
        loss_cells += range(cell, cell + completion)
        # An episode's mask leaves its environment replies out of every sum over the mask.
        loss_values += seq.completion_mask if seq.completion_mask else [1.0] * completion
        logprob_values += seq.generator_logprobs
    flat_ids = torch.tensor(ids, dtype=torch.long)
    if packed:
        input_ids = flat_ids.unsqueeze(0)
        position_ids = torch.tensor([i for n in lengths for i in range(n)]).unsqueeze(0)
        cu_seqlens = torch.tensor([*starts, total], dtype=torch.int32)
        mask = None
    else:
        real = torch.tensor(
            [row * length + i for row, n in enumerate(lengths) for i in range(n)],
            dtype=torch.long,
        )
        input_ids = torch.full((rows, length), pad_id, dtype=torch.long)
        input_ids.view(-1)[real] = flat_ids
        position_ids = cu_seqlens = None
        mask = None
        if attention_mask:
            mask = torch.zeros((rows, length), dtype=torch.long)
            mask.view(-1)[real] = 1
    cells = torch.tensor(loss_cells, dtype=torch.long)
    loss_mask = torch.zeros((rows, length - 1))
    loss_mask.view(-1)[cells] = torch.tensor(loss_values, dtype=loss_mask.dtype)
    generator_logprobs = torch.zeros((rows, length - 1))
    generator_logprobs.view(-1)[cells] = torch.tensor(logprob_values, dtype=torch.float32)
    gather_index = torch.zeros((rows, length - 1), dtype=torch.long)
    gather_index.view(-1)[cells] = torch.arange(1, len(loss_cells) + 1)
    advantages = torch.tensor([s.advantage for s in sequences], dtype=torch.float32)
    return MicroBatch(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=position_ids,
        cu_seqlens=cu_seqlens,
        max_seqlen=length,
        token_index=torch.tensor(token_index, dtype=torch.long),
        token_targets=torch.tensor(targets, dtype=torch.long),
        gather_index=gather_index,
        loss_mask=loss_mask,
        generator_logprobs=generator_logprobs,
        advantages=advantages,
    )


def _starts(lengths: Sequence[int]) -> list[int]:
    """Where each sequence starts in the concatenation of all: [0, n_0, n_0 + n_1, ...]."""
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def _micro_batches(
    sequences: Sequence[trainer_pb2.TrainSequence],
    max_sequences: int,
    max_tokens: int | None,
    packed: bool,
) -> list[list[trainer_pb2.TrainSequence]]:
    """Cut ``sequences`` in order into micro-batches of at most ``max_sequences`` sequences and,
    if set, at most ``max_tokens`` computed tokens (packed: the sum of the lengths; rows: rows x
    the longest). A sequence longer than ``max_tokens`` gets a micro-batch of its own."""
    parts: list[list[trainer_pb2.TrainSequence]] = []
    current: list[trainer_pb2.TrainSequence] = []
    total = longest = 0
    for seq in sequences:
        length = len(seq.prompt_ids) + len(seq.completion_ids)
        new_total, new_longest = total + length, max(longest, length)
        cost = new_total if packed else (len(current) + 1) * new_longest
        full = len(current) == max_sequences or (max_tokens is not None and cost > max_tokens)
        if current and full:
            parts.append(current)
            current, new_total, new_longest = [], length, length
        current.append(seq)
        total, longest = new_total, new_longest
    if current:
        parts.append(current)
    return parts


def split_for_rank(
    sequences: Sequence[trainer_pb2.TrainSequence],
    dp_rank: int,
    dp_size: int,
    micro_batch_size: int,
    micro_batch_tokens: int | None = None,
    packed: bool = False,
) -> list[list[trainer_pb2.TrainSequence]]:
    """This data-parallel rank's micro-batches (see :func:`_micro_batches` for the limits).
    Every rank gets the same number of micro-batches (some possibly empty) because each
    forward/backward is a collective under FSDP: each rank cuts every rank's share (they all
    hold the whole request) and pads its own list to the longest."""
    per_rank = math.ceil(len(sequences) / dp_size)
    plans = [
        _micro_batches(
            sequences[rank * per_rank : (rank + 1) * per_rank],
            micro_batch_size,
            micro_batch_tokens,
            packed,
        )
        for rank in range(dp_size)
    ]
    count = max(1, *(len(plan) for plan in plans))
    mine = plans[dp_rank]
    return mine + [[] for _ in range(count - len(mine))]


# -- packed attention ------------------------------------------------------------------------------


def _flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scaling: float | None,
) -> torch.Tensor:
    """[1, H, T, D] q and [1, Hkv, T, D] k/v → [1, T, H, D], causal within each sequence."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    out = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False, scale=scaling
    )[0]
    return out.unsqueeze(0)


def _per_length_sdpa(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scaling: float | None,
) -> torch.Tensor:
    """The same as :func:`_flash_varlen` with one causal SDPA call per distinct sequence
    length: the packed sequences of one length are gathered into rows ``[n, H, L, D]``, so each
    sequence attends exactly as alone. GRPO groups repeat a few lengths (a batch of 128
    sequences of 6 lengths is 6 calls, not 128 calls and their backward, each a Python
    round trip)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    starts = cu_seqlens[:-1].tolist()
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, lengths, strict=True):
        by_length.setdefault(length, []).append(start)
    device = query.device
    parts, order = [], []
    for length, group in by_length.items():
        # Token positions of the group's sequences, sequence after sequence: [n * L].
        index = (
            torch.tensor(group, device=device).unsqueeze(1) + torch.arange(length, device=device)
        ).reshape(-1)
        rows = [
            t[0].index_select(1, index).unflatten(1, (len(group), length)).transpose(0, 1)
            for t in (query, key, value)
        ]  # [n, heads, L, D] each
        out = sdpa_attention_forward(module, *rows, None, scaling=scaling, is_causal=True)[0]
        parts.append(out.reshape(len(group) * length, *out.shape[2:]))  # [n * L, H, D]
        order.append(index)
    # Back to the packed order: position p of the row is output row inverse[p].
    gathered = torch.cat(order)
    inverse = torch.empty_like(gathered)
    inverse[gathered] = torch.arange(gathered.numel(), device=device)
    return torch.cat(parts).index_select(0, inverse).unsqueeze(0)


def podrl_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q ``[B, H, T, D]``, k/v ``[B, Hkv, T, D]`` →
    (``[B, T, H, D]``, None). See the module docstring."""
    if attention_mask is not None or dropout:
        raise ValueError(
            f"{ATTENTION_NAME} attention takes no attention mask and no dropout (packed or "
            "right-padded causal batches only)"
        )
    cu_seqlens = kwargs.get(CU_SEQLENS_KWARG)
    if cu_seqlens is None:
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling)
    if not isinstance(cu_seqlens, torch.Tensor) or query.shape[0] != 1:
        raise ValueError(f"{CU_SEQLENS_KWARG}: an int32 tensor for one packed row is required")
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        # A plain one-rank module computes under autocast, where q and k leave their fp32
        # RMSNorm in fp32: the varlen kernel takes them in the compute dtype, as SDPA's own
        # autocast rule casts them.
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = (t.to(dtype) for t in (query, key, value))
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        max_seqlen = kwargs.get(MAX_SEQLEN_KWARG)
        if not isinstance(max_seqlen, int):
            raise ValueError(f"{MAX_SEQLEN_KWARG}: the longest packed sequence, an int")
        return _flash_varlen(query, key, value, cu_seqlens, max_seqlen, scaling), None
    return _per_length_sdpa(module, query, key, value, cu_seqlens, scaling), None


AttentionInterface.register(ATTENTION_NAME, podrl_attention)


# -- per-token logprobs ---------------------------------------------------------------------------


def _chunk_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of ``targets``, logsumexp, entropy) of one chunk of logits ``[c, V]``, in fp32."""
    z = logits.float() / temperature
    # The same log_softmax as the plain path (its values, row by row), and the logsumexp that
    # backward needs; inductor fuses both into passes over the logits when compiled.
    log_probs = torch.log_softmax(z, dim=-1)
    lse = torch.logsumexp(z, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(torch.exp(log_probs) * log_probs).sum(-1)
    return chosen, lse, entropy


def _chunk_grad_logits(
    logits: torch.Tensor,
    lse: torch.Tensor,
    targets: torch.Tensor,
    grad: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """d(sum_i grad_i * logprob_i) / d logits for one chunk, in the logits' dtype."""
    z = logits.float() / temperature
    probs = torch.exp(z - lse.unsqueeze(-1))
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab.unsqueeze(0) == targets.unsqueeze(-1)).to(torch.float32)
    return ((onehot - probs) * (grad.unsqueeze(-1) / temperature)).to(logits.dtype)


@dataclass(frozen=True)
class ChunkKernels:
    """The element-wise parts of a chunk, eager or compiled (inductor fuses each into one or
    two passes over the bf16 logits instead of several over fp32 copies)."""

    stats: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    grad_logits: Callable[..., torch.Tensor]

    @classmethod
    def make(cls, compiled: bool) -> ChunkKernels:
        if not compiled:
            return cls(_chunk_stats, _chunk_grad_logits)
        return cls(
            torch.compile(_chunk_stats, dynamic=True),
            torch.compile(_chunk_grad_logits, dynamic=True),
        )


EAGER_KERNELS = ChunkKernels.make(compiled=False)


class FusedLinearLogprobs(torch.autograd.Function):
    """``(logprobs, entropy) = f(hidden [N, D], weight [V, D], targets [N])``, chunked over N.

    ``entropy`` carries no gradient (it is a metric). See the module docstring.
    """

    # Under autocast (a plain one-rank module on CUDA) backward recomputes the chunks' logits in
    # bf16 as forward did, not in fp32.
    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        temperature: float,
        chunk_tokens: int,
        kernels: ChunkKernels,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = hidden.shape[0]
        logprobs = hidden.new_empty(rows, dtype=torch.float32)
        lse = hidden.new_empty(rows, dtype=torch.float32)
        entropy = hidden.new_empty(rows, dtype=torch.float32)
        for start in range(0, rows, chunk_tokens):
            stop = min(start + chunk_tokens, rows)
            logits = hidden[start:stop] @ weight.t()
            lp, ls, ent = kernels.stats(logits, targets[start:stop], temperature)
            logprobs[start:stop], lse[start:stop], entropy[start:stop] = lp, ls, ent
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_tokens, ctx.kernels = temperature, chunk_tokens, kernels
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(
        ctx: torch.autograd.function.FunctionCtx,
        grad_logprobs: torch.Tensor | None,
        _grad_entropy: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        rows, chunk = hidden.shape[0], ctx.chunk_tokens
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        chunks = range(0, rows, chunk)
        # One chunk: the matmul's own output is the gradient. Several: add the chunks' products
        # in fp32 so the bf16 rounding happens once per chunk, not once per running sum.
        grad_weight = None
        if want_weight and len(chunks) != 1:
            grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        for start in chunks:
            stop = min(start + chunk, rows)
            h = hidden[start:stop]
            dlogits = ctx.kernels.grad_logits(
                h @ weight.t(),
                lse[start:stop],
                targets[start:stop],
                grad_logprobs[start:stop],
                ctx.temperature,
            )
            if want_hidden:
                grad_hidden[start:stop] = dlogits @ weight
            if want_weight:
                part = dlogits.t() @ h
                grad_weight = part if len(chunks) == 1 else grad_weight.add_(part)
        if want_weight:
            # Zero tokens still give the weight a (zero) gradient: every FSDP rank must reduce
            # the same parameters, also a rank whose micro-batch is an all-masked dummy.
            grad_weight = torch.zeros_like(weight) if grad_weight is None else grad_weight
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    kernels: ChunkKernels = EAGER_KERNELS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of ``targets`` [N] and entropy [N] under ``softmax(hidden @ weight.T / T)``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return FusedLinearLogprobs.apply(hidden, weight, targets, temperature, chunk_tokens, kernels)


def plain_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: full fp32 log-softmax over the vocabulary, then gather (``[N, V]`` in)."""
    log_probs = F.log_softmax(logits.float() / temperature, dim=-1)
    chosen = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


@dataclass
class HeadRequest:
    """What :class:`LogprobHead` computes during one forward: logprobs of ``targets`` at the
    flat positions ``token_index`` of the ``[rows * length]`` hidden states. The head returns
    the logprobs as the model's ``logits`` output and leaves the entropy here."""

    token_index: torch.Tensor  # [M] long
    targets: torch.Tensor  # [M] long
    temperature: float = 1.0
    chunk_tokens: int = 4096
    kernels: ChunkKernels = EAGER_KERNELS
    entropy: torch.Tensor | None = field(default=None, init=False)


class LogprobHead(nn.Linear):
    """An ``nn.Linear`` vocabulary projection that returns per-token logprobs while
    ``self.request`` is set (see the module docstring); plain logits otherwise."""

    request: HeadRequest | None = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self.request
        if request is None:
            return super().forward(hidden)
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, request.token_index)
        logprobs, entropy = fused_linear_logprobs(
            flat,
            self.weight,
            request.targets,
            request.temperature,
            request.chunk_tokens,
            request.kernels,
        )
        request.entropy = entropy
        return logprobs


def install_logprob_head(model: nn.Module) -> LogprobHead:
    """Turn ``model``'s output projection into a :class:`LogprobHead` in place (same parameter
    objects, same state-dict keys, tied weights stay tied)."""
    head = model.get_output_embeddings()
    if type(head) is LogprobHead:
        return head
    if type(head) is not nn.Linear or head.bias is not None:
        raise TypeError(
            f"trainer.fused_logprobs: the model's output projection is {type(head).__name__}"
            f"{' with a bias' if getattr(head, 'bias', None) is not None else ''}; the fused "
            "head needs a bias-free nn.Linear: set trainer.fused_logprobs: false"
        )
    head.__class__ = LogprobHead
    return head


@contextmanager
def request_logprobs(model: nn.Module, request: HeadRequest) -> Iterator[HeadRequest]:
    """Within the block, ``model(...).logits`` is ``[M]`` logprobs of ``request.targets``."""
    head = model.get_output_embeddings()
    if not isinstance(head, LogprobHead):
        raise TypeError("request_logprobs: call install_logprob_head(model) first")
    head.request = request
    try:
        yield request
    finally:
        head.request = None
