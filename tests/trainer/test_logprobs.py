"""The fused, chunked logprobs equal the plain full-vocabulary log-softmax in fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from podrl.trainer.batch import (
    ChunkKernels,
    HeadRequest,
    LogprobHead,
    fused_linear_logprobs,
    install_logprob_head,
    plain_logprobs,
    request_logprobs,
)

TOL = dict(rtol=1e-5, atol=1e-6)


def _inputs(seed: int, tokens: int = 13, dim: int = 16, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    upstream = torch.randn(tokens, generator=gen)
    return hidden, weight, targets, upstream


def _plain(hidden, weight, targets, temperature):
    return plain_logprobs(hidden @ weight.t(), targets, temperature)


@pytest.mark.parametrize("chunk_tokens", [1, 5, 13, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_equals_plain_values_and_gradients(chunk_tokens, temperature):
    hidden, weight, targets, upstream = _inputs(seed=chunk_tokens)
    fused_lp, fused_entropy = fused_linear_logprobs(
        hidden, weight, targets, temperature, chunk_tokens
    )
    fused_grads = torch.autograd.grad((fused_lp * upstream).sum(), (hidden, weight))
    plain_lp, plain_entropy = _plain(hidden, weight, targets, temperature)
    plain_grads = torch.autograd.grad((plain_lp * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(fused_lp, plain_lp, **TOL)
    torch.testing.assert_close(fused_entropy, plain_entropy, **TOL)
    for fused, plain in zip(fused_grads, plain_grads, strict=True):
        # The gradient sums V terms of either sign: allow fp32 reassociation at its scale.
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-6 * plain.abs().max())
    assert not fused_entropy.requires_grad  # a metric: no gradient flows through it


def test_the_element_wise_kernels_can_be_passed_in():
    """The head runs whatever ChunkKernels it is given (the engine passes compiled ones on
    CUDA); here counting wrappers around the eager kernels: one stats call per chunk in
    forward, one gradient call per chunk in backward."""
    eager = ChunkKernels.make(compiled=False)
    calls = {"stats": 0, "grad": 0}

    def stats(*args):
        calls["stats"] += 1
        return eager.stats(*args)

    def grad_logits(*args):
        calls["grad"] += 1
        return eager.grad_logits(*args)

    hidden, weight, targets, upstream = _inputs(seed=3)
    logprobs, _ = fused_linear_logprobs(
        hidden, weight, targets, 1.0, 5, ChunkKernels(stats, grad_logits)
    )
    (logprobs * upstream).sum().backward()
    assert calls == {"stats": 3, "grad": 3}  # 13 tokens in chunks of 5


def test_no_tokens_still_gives_the_weight_a_zero_gradient():
    """An all-masked dummy micro-batch (a DP rank without data) must still produce a weight
    gradient, or FSDP ranks would reduce different parameter sets."""
    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    logprobs, _ = fused_linear_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long))
    logprobs.sum().backward()
    assert weight.grad is not None and torch.equal(weight.grad, torch.zeros_like(weight))


def test_head_in_a_model_returns_the_plain_logprobs_of_the_requested_positions(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    keys = list(model.state_dict())
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    full_logits = model(input_ids=ids).logits
    head = install_logprob_head(model)
    assert isinstance(head, LogprobHead) and isinstance(head, nn.Linear)
    assert list(model.state_dict()) == keys  # checkpoints and exports see the same names
    # Outside a request the head is the plain projection.
    torch.testing.assert_close(model(input_ids=ids).logits, full_logits, rtol=0, atol=0)
    positions = torch.tensor([1, 4, 8, 10, 16])  # flat positions of the [2 * 9] outputs
    targets = torch.tensor([5, 7, 9, 11, 13])
    request = HeadRequest(positions, targets, temperature=0.5, chunk_tokens=2)
    with request_logprobs(model, request):
        logprobs = model(input_ids=ids).logits
    expected, expected_entropy = plain_logprobs(
        full_logits.reshape(-1, full_logits.shape[-1])[positions], targets, 0.5
    )
    torch.testing.assert_close(logprobs, expected, **TOL)
    torch.testing.assert_close(request.entropy, expected_entropy, **TOL)
    assert head.request is None  # the request ends with the block


def test_a_head_with_a_bias_is_refused_with_the_fix(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    head = model.get_output_embeddings()
    model.lm_head = nn.Linear(head.in_features, head.out_features, bias=True)
    with pytest.raises(TypeError, match=r"with a bias.*fused_logprobs: false"):
        install_logprob_head(model)
