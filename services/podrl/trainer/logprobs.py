"""Per-token logprobs of the sampled tokens without materialising full-vocabulary fp32 logits.

The policy loss needs, for each completion token, ``log softmax(h @ W.T / T)[target]`` (plus the
entropy of that distribution as a metric). Computed the plain way, a micro-batch of N tokens
holds an ``[N, V]`` bf16 logits tensor, its fp32 copy, the fp32 log-softmax and, in backward,
fp32 gradients of each: with Qwen3's 151,936-token vocabulary that is ~2.4 GB per 1,000 tokens.

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

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn


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

    @staticmethod
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
