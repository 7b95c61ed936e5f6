"""Attention for packed and right-padded micro-batches, with no attention mask.

GRPO samples have very different lengths. Padded to the longest, a micro-batch computes every
layer on padding; packed (all sequences of the micro-batch one after another in a single row,
positions restarting at 0 for each), it computes only real tokens. Attention must then stay
inside each sequence: a block-diagonal causal pattern given by the cumulative sequence
lengths ``cu_seqlens`` (``[0, n_0, n_0 + n_1, ...]``).

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
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "podrl_sdpa"

# The keyword arguments a packed forward passes to ``model(...)``; transformers hands them on to
# every attention call.
CU_SEQLENS_KWARG = "packed_cu_seqlens"
MAX_SEQLEN_KWARG = "packed_max_seqlen"


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
    if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
        max_seqlen = kwargs.get(MAX_SEQLEN_KWARG)
        if not isinstance(max_seqlen, int):
            raise ValueError(f"{MAX_SEQLEN_KWARG}: the longest packed sequence, an int")
        return _flash_varlen(query, key, value, cu_seqlens, max_seqlen, scaling), None
    return _per_length_sdpa(module, query, key, value, cu_seqlens, scaling), None


AttentionInterface.register(ATTENTION_NAME, podrl_attention)
