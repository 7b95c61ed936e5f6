"""Packed micro-batches: same loss and gradients as padded rows, and no attention across
sequences."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from podrl.algorithms.losses import LossSettings, policy_loss
from podrl.config import ConfigError, load_config
from podrl.trainer.batch import (
    ATTENTION_NAME,
    HeadRequest,
    batch_totals,
    collate,
    install_logprob_head,
    request_logprobs,
    split_for_rank,
)
from podrl.trainer.engine import TrainerEngine
from tests.trainer.rank_worker import config_env, make_request

PAD = 0


def _stock_padded_loss(model, sequences):
    """The reference: right-padded rows, transformers' own SDPA with the padding mask, full
    logits and a full fp32 log-softmax (what the trainer did before packing)."""
    batch = collate(sequences, PAD, packed=False, attention_mask=True)
    model.set_attn_implementation("sdpa")
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logprobs = log_probs.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return batch, logprobs


def _packed_logprobs(model, sequences):
    batch = collate(sequences, PAD, packed=True)
    model.set_attn_implementation(ATTENTION_NAME)
    request = HeadRequest(batch.token_index, batch.token_targets, chunk_tokens=7)
    with request_logprobs(model, request):
        flat = model(**batch.model_inputs()).logits
    return batch, batch.to_rows(flat)


def _loss(batch, logprobs, sequences):
    settings = LossSettings(mode="grpo")
    return policy_loss(
        logprobs,
        batch.generator_logprobs,
        batch.advantages,
        batch.loss_mask,
        settings,
        batch_totals(sequences),
    ).loss


@pytest.fixture
def model(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    install_logprob_head(model)
    return model


def test_packed_batch_gives_the_padded_loss_and_gradients(model):
    sequences = list(make_request(seed=5, sequences=5).sequences)
    assert len({len(s.prompt_ids) + len(s.completion_ids) for s in sequences}) > 1  # padding

    padded, padded_logprobs = _stock_padded_loss(model, sequences)
    padded_loss = _loss(padded, padded_logprobs, sequences)
    padded_loss.backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    packed, packed_logprobs = _packed_logprobs(model, sequences)
    assert packed.input_ids.shape[0] == 1
    assert packed.input_ids.numel() < padded.input_ids.numel()  # padding is not computed
    packed_loss = _loss(packed, packed_logprobs, sequences)
    packed_loss.backward()

    assert packed_loss.item() == pytest.approx(padded_loss.item(), rel=1e-5, abs=1e-5)
    mask = padded.loss_mask.bool()
    torch.testing.assert_close(packed_logprobs[mask], padded_logprobs[mask], rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        expected = padded_grads[name]
        scale = expected.abs().max().item()
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_packed_sequences_of_one_length_are_one_attention_call_with_the_padded_result(
    model, monkeypatch
):
    """Off flash attention (CPU), the packed sequences of each length go through one causal
    SDPA call as rows, and the loss, logprobs and gradients are still those of padded rows."""
    import podrl.trainer.batch as batch_module

    base = list(make_request(seed=12, sequences=3).sequences)
    sequences = []
    for shift in (0, 13, 29):  # the three lengths, interleaved, each three times
        for seq in base:
            copy = type(seq)()
            copy.CopyFrom(seq)
            copy.prompt_ids[:] = [(t + shift) % 100 + 3 for t in seq.prompt_ids]
            copy.completion_ids[:] = [(t + shift) % 100 + 3 for t in seq.completion_ids]
            sequences.append(copy)
    lengths = {len(s.prompt_ids) + len(s.completion_ids) for s in sequences}
    assert len(lengths) == 3

    padded, padded_logprobs = _stock_padded_loss(model, sequences)
    padded_loss = _loss(padded, padded_logprobs, sequences)
    padded_loss.backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    calls = []
    real = batch_module.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return real(module, query, *args, **kwargs)

    monkeypatch.setattr(batch_module, "sdpa_attention_forward", counted)
    packed, packed_logprobs = _packed_logprobs(model, sequences)
    packed_loss = _loss(packed, packed_logprobs, sequences)
    packed_loss.backward()

    layers = model.config.num_hidden_layers
    assert len(calls) == 3 * layers  # one per length and layer, not one per sequence
    assert sorted({(shape[0], shape[2]) for shape in calls}) == [(3, n) for n in sorted(lengths)]
    assert packed_loss.item() == pytest.approx(padded_loss.item(), rel=1e-5, abs=1e-5)
    mask = padded.loss_mask.bool()
    torch.testing.assert_close(packed_logprobs[mask], padded_logprobs[mask], rtol=1e-5, atol=1e-5)
    for name, param in model.named_parameters():
        expected = padded_grads[name]
        scale = expected.abs().max().item()
        torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_packed_sequences_do_not_attend_to_each_other(model):
    """Changing every token of the first sequence leaves the second one's logprobs as they
    were: attention and positions restart at each sequence boundary."""
    first, second = make_request(seed=7, sequences=2).sequences
    _, before = _packed_logprobs(model, [first, second])
    first.prompt_ids[:] = [(t + 17) % 100 + 3 for t in first.prompt_ids]
    first.completion_ids[:] = [(t + 29) % 100 + 3 for t in first.completion_ids]
    _, after = _packed_logprobs(model, [first, second])
    torch.testing.assert_close(after[1], before[1], rtol=1e-6, atol=1e-6)
    assert not torch.allclose(after[0], before[0])


def test_packed_layout_puts_each_sequence_after_the_previous_one():
    sequences = list(make_request(seed=2, sequences=3).sequences)
    batch = collate(sequences, PAD, packed=True)
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in sequences]
    assert batch.cu_seqlens.tolist() == [0, lengths[0], lengths[0] + lengths[1], sum(lengths)]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == max(lengths)
    assert batch.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    # The targets are the completion tokens, in order.
    assert batch.token_targets.tolist() == [t for s in sequences for t in s.completion_ids]
    flat_ids = batch.input_ids.reshape(-1)
    assert torch.equal(flat_ids[batch.token_index + 1], batch.token_targets)


def _engine_metrics(tiny_model, tmp_path, **trainer: object) -> list[tuple[float, ...]]:
    env = config_env(str(tiny_model), str(tmp_path), **trainer)
    engine = TrainerEngine.build(load_config(None, {**os.environ, **env}))
    try:
        metrics = []
        for seed in (1, 2):
            m = engine.train_step(make_request(seed, version=engine.policy_version)).metrics
            metrics.append((m.loss, m.entropy, m.grad_norm, m.logprob_diff_max, m.tokens))
        return metrics
    finally:
        engine.close()


def test_engine_trains_the_same_packed_padded_fused_or_plain(tiny_model, tmp_path):
    """Two optimizer steps: packing and the fused logprobs change no metric beyond fp32
    rounding (the second step also checks the updated weights agree)."""
    reference = _engine_metrics(tiny_model, tmp_path, packing=False, fused_logprobs=False)
    for options in ({"packing": True}, {"packing": False, "fused_logprobs": True}):
        got = _engine_metrics(tiny_model, tmp_path, **options)
        for step, (a, b) in enumerate(zip(got, reference, strict=True)):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (options, step)
    assert reference[0][0] != reference[1][0]


def test_packing_with_eager_attention_is_refused_with_the_fix(tmp_path):
    env = {"PODRL_RUN_DIR": str(tmp_path), "PODRL_TRAINER__ATTN_IMPLEMENTATION": "eager"}
    with pytest.raises(ConfigError, match=r"trainer\.packing needs .*set packing: false"):
        load_config(None, env)
    load_config(None, {**env, "PODRL_TRAINER__PACKING": "false"})


def _sequences(lengths: list[int]) -> list:
    request = make_request(seed=0, sequences=len(lengths))
    for seq, n in zip(request.sequences, lengths, strict=True):
        seq.prompt_ids[:] = [5] * (n // 2)
        seq.completion_ids[:] = [6] * (n - n // 2)
        seq.generator_logprobs[:] = [-1.0] * (n - n // 2)
    return list(request.sequences)


def test_equal_lengths_stay_rows_without_padding():
    batch = collate(_sequences([6, 6, 6]), PAD, packed=True)
    assert batch.input_ids.shape == (3, 6)
    assert batch.cu_seqlens is None and batch.position_ids is None


def _lengths(parts: list[list]) -> list[list[int]]:
    return [[len(s.prompt_ids) + len(s.completion_ids) for s in part] for part in parts]


def test_token_budget_cuts_micro_batches_and_ranks_agree_on_their_count():
    sequences = _sequences([10, 10, 10, 30, 5, 5, 40, 10])
    # Packed: the sum of lengths per micro-batch stays within 32; a longer one goes alone.
    packed = split_for_rank(
        sequences, 0, 1, micro_batch_size=64, micro_batch_tokens=32, packed=True
    )
    assert _lengths(packed) == [[10, 10, 10], [30], [5, 5], [40], [10]]
    # Rows: rows x the longest stays within 32.
    rows = split_for_rank(sequences, 0, 1, micro_batch_size=64, micro_batch_tokens=32, packed=False)
    assert _lengths(rows) == [[10, 10, 10], [30], [5, 5], [40], [10]]
    rows = split_for_rank(_sequences([4, 12, 4]), 0, 1, 64, micro_batch_tokens=24, packed=False)
    assert _lengths(rows) == [[4, 12], [4]]  # 3 rows x 12 would be 36
    # Two DP ranks: rank 0 holds the first four (2 micro-batches), rank 1 the last four (3);
    # rank 0 gets an empty fourth micro-batch so the FSDP collectives line up.
    rank0 = split_for_rank(sequences, 0, 2, micro_batch_size=64, micro_batch_tokens=32, packed=True)
    rank1 = split_for_rank(sequences, 1, 2, micro_batch_size=64, micro_batch_tokens=32, packed=True)
    assert _lengths(rank0) == [[10, 10, 10], [30], []]
    assert _lengths(rank1) == [[5, 5], [40], [10]]
