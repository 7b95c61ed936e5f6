"""Data parallelism across pods with real processes: a ``podrl-lighthouse``, trainer
services of one gloo rank each as pods, torchft quorums on loopback, a single-pod trainer
(no Lighthouse) as the reference.

The GRPO pods are shared by the stages of one scenario test, run in this order:

1. two pods train a batch split between them (and then a batch one pod holds alone, the other
   an empty share) to the loss and parameters of one pod on the whole batch;
2. a pod SIGKILLed in the middle of a step: the other answers ABORTED with its parameters
   unchanged, then trains the whole batch alone to the single-pod result;
3. a pod started after those steps heals from its peer in its first step: same digest, same
   version;
4. with that pod lost before the next step, pod a's Train waiting for its share is cancelled
   and steps nothing.

Between 1 and 2, a batch whose totals contradict its shares is refused at once.

The DAPO test and the test of pods of 2 FSDP2 ranks have processes (and a Lighthouse) of their
own; the DAPO one also has a pod fail after the exchange (its peer applies the step, it heals
in the next one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tests.trainer.pods import (
    Lighthouse,
    Pod,
    fault_plan,
    max_abs_diff,
    no_auth_env,
    share,
    start_lighthouse,
    start_pods,
    train_together,
)
from tests.trainer.rank_worker import make_request

pytestmark = pytest.mark.slow

SEQUENCES = 8
TOLERANCE = 1e-5
# AdamW's epsilon for every pod here. An update is lr * g / (|g| + eps): for a gradient
# element near zero it changes by about lr * dg / eps, and summing a batch in two pods' parts
# instead of one rounds g differently (dg ~ 1e-10). With the default 1e-8 that is ~1e-5 (it
# measured 1.5e-5 on one machine, under 1e-5 on another); with 1e-6, 1.4e-6.
TRAINER = {"adam_eps": 1e-6}
# Pod "b" stalls before its cross-pod exchange of the step from version 2 (the kill test).
STALL = fault_plan(
    {
        "point": "trainer.before_cross_pod_allreduce",
        "action": "delay",
        "seconds": 300,
        "version": 2,
    }
)


@pytest.fixture(scope="module")
def lighthouse(tmp_path_factory):
    server = start_lighthouse(tmp_path_factory.mktemp("lighthouse"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def grpo(tiny_model, lighthouse, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cross-pod-grpo")
    reference = start_pods(tiny_model, tmp, ["reference"], lighthouse=None, **TRAINER)
    pods = start_pods(
        tiny_model,
        tmp,
        ["pod-a", "pod-b"],
        lighthouse=lighthouse.address,
        extra_env={"pod-b": STALL},
        **TRAINER,
    )
    everyone = {**reference, **pods}
    yield everyone, tmp
    for pod in everyone.values():
        pod.kill()


def _same_metrics(a, b) -> None:
    for field in (
        "loss",
        "pg_loss",
        "entropy",
        "ratio_mean",
        "grad_norm",
        "logprob_diff_mean",
        # Sums and maxima over the pods; the pods' parameters are the same, so the update too.
        "logprob_diff_max",
        "ratio_min",
        "ratio_max",
        "is_weight_mean",
        "is_weight_min",
        "is_weight_max",
        "clip_fraction_low",
        "clip_fraction_high",
        "mismatch_kl",
        "update_ratio",
    ):
        assert abs(getattr(a.metrics, field) - getattr(b.metrics, field)) <= TOLERANCE, field
    assert a.metrics.tokens == b.metrics.tokens


def two_pods_train_a_split_batch_as_one_pod(everyone: dict[str, Pod], tmp: Path) -> None:
    """From version 0 to 2: a batch split between two pods, then one held by pod a alone."""
    reference, a, b = everyone["reference"], everyone["pod-a"], everyone["pod-b"]

    # A trainer without a Lighthouse refuses a share: it would step on a part of the batch.
    with pytest.raises(grpc.RpcError) as refused:
        reference.stub.Train(share(make_request(11, SEQUENCES), range(3), "0/ref", 2), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "TrainRequest.pods: 2 pods" in refused.value.details()

    # Pod b refuses its share (a version it does not hold): pod a steps neither.
    batch = make_request(11, sequences=SEQUENCES, version=0)
    wrong = share(batch, range(3, 8), "0/b", pods=2)
    wrong.policy_version = 5
    replies = train_together({a: share(batch, range(0, 3), "0/a", pods=2), b: wrong}, timeout=180)
    assert replies["pod-b"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "TrainRequest.policy_version" in replies["pod-b"].details()
    assert replies["pod-a"].code() == grpc.StatusCode.ABORTED
    assert "refused their share" in replies["pod-a"].details()
    assert a.digest() == b.digest() and a.digest().policy_version == 0

    # Step 1: a part of the batch each.
    batch = make_request(11, sequences=SEQUENCES, version=0)
    alone = reference.stub.Train(batch, timeout=180)
    replies = train_together(
        {
            # Unequal shares: per-pod denominators would weight the pods' tokens differently.
            a: share(batch, range(0, 3), "1/a", pods=2),
            b: share(batch, range(3, 8), "1/b", pods=2),
        },
        timeout=180,
    )
    assert not [r for r in replies.values() if isinstance(r, grpc.RpcError)], replies
    for reply in replies.values():
        assert (reply.policy_version, reply.step) == (1, 1)
        _same_metrics(reply, alone)  # the loss and metrics of the whole batch, on every pod
    assert a.digest().sha256 == b.digest().sha256
    expected = reference.parameters(tmp / "ref-1")
    assert max_abs_diff(a.parameters(tmp / "a-1"), expected) <= TOLERANCE

    # Step 2: pod b's share is empty, and it still takes part in the step.
    batch = make_request(12, sequences=SEQUENCES, version=1)
    alone = reference.stub.Train(batch, timeout=180)
    replies = train_together(
        {
            a: share(batch, range(SEQUENCES), "2/a", pods=2),
            b: share(batch, [], "2/b", pods=2),
        },
        timeout=180,
    )
    assert not [r for r in replies.values() if isinstance(r, grpc.RpcError)], replies
    for reply in replies.values():
        assert reply.policy_version == 2
        _same_metrics(reply, alone)
    assert a.digest() == b.digest()
    assert max_abs_diff(b.parameters(tmp / "b-2"), reference.parameters(tmp / "ref-2")) <= (
        TOLERANCE
    )


def a_batch_whose_totals_contradict_its_shares_is_refused_at_once(everyone: dict[str, Pod]) -> None:
    """One pod whose share is not the totals it names (pods 1), and two pods whose shares do
    not make up the totals once both are in the quorum: INVALID_ARGUMENT naming the field at
    once, instead of forming the quorum again until the deadline; nothing stepped."""
    a, b = everyone["pod-a"], everyone["pod-b"]
    before = a.digest()
    batch = make_request(16, sequences=SEQUENCES, version=before.policy_version)
    alone = share(batch, range(3), "x/a", pods=1)
    alone.global_completion_tokens = 999
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as refused:
        a.stub.Train(alone, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("TrainRequest.global_completion_tokens: one pod")
    assert time.monotonic() - started < 5

    tokens = sum(len(s.completion_ids) for s in batch.sequences)
    shares = {a: share(batch, range(0, 3), "y/a", pods=2), b: share(batch, range(3, 8), "y/b", 2)}
    for request in shares.values():
        request.global_completion_tokens = tokens + 5  # each share fits; together they do not
    started = time.monotonic()
    replies = train_together(shares, timeout=180)
    for name, reply in replies.items():
        assert isinstance(reply, grpc.RpcError), name
        assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT, reply.details()
        assert "the 2 pods of this step hold 8 sequences" in reply.details()
    assert time.monotonic() - started < 30
    assert a.digest() == b.digest() == before


def a_pod_killed_mid_step_leaves_its_peer_unchanged(everyone: dict[str, Pod], tmp: Path) -> None:
    """From version 2 (where pod b's fault plan stalls it): b killed, a alone to version 3."""
    reference, a, b = everyone["reference"], everyone["pod-a"], everyone["pod-b"]
    before = a.digest()
    assert before.policy_version == 2  # pod b's fault plan stalls the step from version 2

    batch = make_request(13, sequences=SEQUENCES, version=2)
    with ThreadPoolExecutor(2) as pool:
        trained_a = pool.submit(a.stub.Train, share(batch, range(0, 5), "3/a", 2), timeout=180)
        trained_b = pool.submit(b.stub.Train, share(batch, range(5, 8), "3/b", 2), timeout=180)
        # Pod b stalls at its exchange (its fault plan): a waits for it there. Kill b.
        deadline = time.monotonic() + 120
        while "injected fault" not in b.log():
            assert time.monotonic() < deadline and not trained_a.done(), b.log()
            time.sleep(0.2)
        b.kill()
        aborted = trained_a.exception(timeout=120)
        trained_b.exception(timeout=60)
    assert isinstance(aborted, grpc.RpcError)
    assert aborted.code() == grpc.StatusCode.ABORTED, aborted.details()
    assert "cross-pod" in aborted.details()
    assert a.digest() == before  # nothing stepped: same version, same parameters

    # The controller sends the step again to the pods left: here pod a, with the whole batch.
    reply = a.stub.Train(share(batch, range(SEQUENCES), "3/a-again", pods=1), timeout=180)
    alone = reference.stub.Train(batch, timeout=180)
    assert reply.policy_version == alone.policy_version == 3
    _same_metrics(reply, alone)
    assert max_abs_diff(a.parameters(tmp / "a-3"), reference.parameters(tmp / "ref-3")) <= (
        TOLERANCE
    )


def a_pod_that_joins_heals_from_its_peer(
    everyone: dict[str, Pod], tmp: Path, tiny_model: Path, lighthouse: Lighthouse
) -> None:
    """Pod c started at version 0 while pod a is at 3: it heals in its first step, to 4."""
    reference, a = everyone["reference"], everyone["pod-a"]
    assert a.info().policy_version == 3  # the kill stage's step
    c = start_pods(tiny_model, tmp, ["pod-c"], lighthouse=lighthouse.address, **TRAINER)["pod-c"]
    everyone["pod-c"] = c  # the fixture stops it
    assert c.info().policy_version == 0
    # Until its first Train a pod does not heartbeat: it cannot hold up the others' quorums.
    assert "pod-c" not in lighthouse.status()

    # Pod c is sent a step for version 3: it heals from pod a before its version check.
    batch = make_request(14, sequences=SEQUENCES, version=3)
    replies = train_together(
        {a: share(batch, range(0, 4), "4/a", 2), c: share(batch, range(4, 8), "4/c", 2)},
        timeout=180,
    )
    assert not [r for r in replies.values() if isinstance(r, grpc.RpcError)], replies
    assert "healed from a peer pod: version 0 -> 3" in c.log()
    assert "pod-c" in lighthouse.status()
    # Pod a asked first, before pod c's manager was up: torchft formed a quorum of pod a
    # alone, and pod a formed it again once the shares did not add up.
    assert "the request names 2 pods: forming the quorum again" in a.log()
    alone = reference.stub.Train(batch, timeout=180)
    for reply in replies.values():
        assert reply.policy_version == 4
        _same_metrics(reply, alone)
    digest_a, digest_c = a.digest(), c.digest()
    assert digest_c == digest_a and digest_c.policy_version == 4
    assert max_abs_diff(c.parameters(tmp / "c-4"), reference.parameters(tmp / "ref-4")) <= (
        TOLERANCE
    )


def a_train_cancelled_while_its_quorum_waits_for_a_lost_pod_steps_nothing(
    everyone: dict[str, Pod],
) -> None:
    """Pod c lost before the step from version 4: pod a's waiting Train, once cancelled, steps
    nothing."""
    a, c = everyone["pod-a"], everyone["pod-c"]
    before = a.digest()
    assert before.policy_version == 4  # the join stage's step
    c.kill()  # lost before the step: the controller's call to it fails, pod a's is cancelled
    deadline = time.monotonic() + 60
    waits = a.log().count("forming the quorum again")
    batch = make_request(15, sequences=SEQUENCES, version=4)
    call = a.stub.Train.future(share(batch, range(0, 4), "5/a", pods=2), timeout=180)
    # Once the Lighthouse stops counting c (no heartbeat), a's quorums hold a alone and a
    # forms them again and again, waiting for c's share.
    while a.log().count("forming the quorum again") == waits:
        assert time.monotonic() < deadline and not call.done(), a.log()[-3000:]
        time.sleep(0.2)
    call.cancel()
    # It gives up at its next look (within a second), not at quorum_timeout_seconds (60 s).
    cancelled = time.monotonic() + 20
    while "the controller cancelled this Train" not in a.log():
        assert time.monotonic() < cancelled, a.log()[-3000:]
        time.sleep(0.2)
    assert a.digest() == before  # nothing stepped
    # The trainer is free for the step re-split over the pods left (here pod a, whole).
    reply = a.stub.Train(share(batch, range(SEQUENCES), "5/a-again", pods=1), timeout=60)
    assert reply.policy_version == 5


def test_grpo_pods_split_refuse_lose_heal_and_cancel(grpo, tiny_model, lighthouse):
    """One scenario on the shared pods (their processes are expensive); each stage starts from
    the versions and pods the stage before left, so they run here, in this order."""
    everyone, tmp = grpo
    two_pods_train_a_split_batch_as_one_pod(everyone, tmp)
    a_batch_whose_totals_contradict_its_shares_is_refused_at_once(everyone)
    a_pod_killed_mid_step_leaves_its_peer_unchanged(everyone, tmp)
    a_pod_that_joins_heals_from_its_peer(everyone, tmp, tiny_model, lighthouse)
    a_train_cancelled_while_its_quorum_waits_for_a_lost_pod_steps_nothing(everyone)


@pytest.fixture
def dapo(tiny_model, tmp_path):
    # A Lighthouse of its own: the GRPO pods still heartbeat to the module's, and a quorum
    # needs more than half of the heartbeating pods (torchft's split-brain rule).
    lighthouse = start_lighthouse(tmp_path)
    pods = start_pods(
        tiny_model,
        tmp_path,
        ["dapo-reference", "dapo-a", "dapo-b"],
        lighthouse=None,
        **TRAINER,
        extra_env={
            "dapo-a": {"PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS": lighthouse.address},
            # Pod b fails after the exchange of the step from version 1 (before its commit).
            "dapo-b": {
                "PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS": lighthouse.address,
                **fault_plan(
                    {"point": "trainer.before_optimizer_step", "action": "raise", "version": 1}
                ),
            },
        },
        loss_mode="dapo",
        clip_eps_high=0.28,
    )
    yield pods, tmp_path
    for pod in pods.values():
        pod.kill()
    assert lighthouse.stop() == 0  # SIGTERM stops it cleanly


def test_dapo_two_pods_as_one_and_a_pod_failing_after_the_exchange(dapo):
    pods, tmp = dapo
    reference, a, b = pods["dapo-reference"], pods["dapo-a"], pods["dapo-b"]
    batch = make_request(21, sequences=SEQUENCES, version=0)
    alone = reference.stub.Train(batch, timeout=180)
    replies = train_together(
        {a: share(batch, range(0, 5), "1/a", 2), b: share(batch, range(5, 8), "1/b", 2)},
        timeout=180,
    )
    assert not [r for r in replies.values() if isinstance(r, grpc.RpcError)], replies
    for reply in replies.values():
        _same_metrics(reply, alone)
    assert a.digest() == b.digest()
    assert max_abs_diff(a.parameters(tmp / "a"), reference.parameters(tmp / "ref")) <= TOLERANCE

    # Pod b fails after the exchange: pod a applied the whole batch (OK), pod b nothing.
    batch = make_request(22, sequences=SEQUENCES, version=1)
    replies = train_together(
        {a: share(batch, range(0, 4), "2/a", 2), b: share(batch, range(4, 8), "2/b", 2)},
        timeout=180,
    )
    assert replies["dapo-a"].policy_version == 2
    assert replies["dapo-b"].code() == grpc.StatusCode.ABORTED
    assert b.digest().policy_version == 1
    _same_metrics(replies["dapo-a"], reference.stub.Train(batch, timeout=180))
    # The step is trained (never sent again); pod b heals from pod a in the next one.
    batch = make_request(23, sequences=SEQUENCES, version=2)
    replies = train_together(
        {a: share(batch, range(0, 4), "3/a", 2), b: share(batch, range(4, 8), "3/b", 2)},
        timeout=180,
    )
    assert not [r for r in replies.values() if isinstance(r, grpc.RpcError)], replies
    assert "healed from a peer pod: version 1 -> 2" in b.log()
    alone = reference.stub.Train(batch, timeout=180)
    for reply in replies.values():
        assert reply.policy_version == 3
        _same_metrics(reply, alone)
    assert a.digest() == b.digest()
    assert max_abs_diff(b.parameters(tmp / "b3"), reference.parameters(tmp / "ref3")) <= (TOLERANCE)


def test_a_lighthouse_on_a_taken_port_says_which(lighthouse):
    done = subprocess.run(
        [sys.executable, "-m", "podrl.trainer.lighthouse", "--bind", lighthouse.address],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **no_auth_env()},
    )
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on {lighthouse.address}" in done.stderr
    assert "--bind" in done.stderr


def test_pods_of_two_ranks_train_and_heal_rank_by_rank(tiny_model, tmp_path):
    """Each pod 2 FSDP2 ranks: rank r of a pod exchanges with, and heals from, rank r of the
    others; the result equals a 2-rank pod alone."""
    lighthouse = start_lighthouse(tmp_path)
    pods: dict[str, Pod] = {}
    try:
        pods.update(
            start_pods(
                tiny_model,
                tmp_path,
                ["wide-reference", "wide-a"],
                lighthouse=None,
                dp_shard=2,
                **TRAINER,
                extra_env={
                    "wide-a": {"PODRL_TRAINER__REPLICATION__LIGHTHOUSE_ADDRESS": lighthouse.address}
                },
            )
        )
        reference, a = pods["wide-reference"], pods["wide-a"]
        batch = make_request(31, sequences=SEQUENCES, version=0)
        _same_metrics(
            a.stub.Train(share(batch, range(SEQUENCES), "1/a", 1), timeout=180),
            reference.stub.Train(batch, timeout=180),
        )
        pods.update(
            start_pods(
                tiny_model,
                tmp_path,
                ["wide-b"],
                lighthouse=lighthouse.address,
                dp_shard=2,
                **TRAINER,
            )
        )
        b = pods["wide-b"]
        batch = make_request(32, sequences=SEQUENCES, version=1)
        replies = train_together(
            {a: share(batch, range(0, 3), "2/a", 2), b: share(batch, range(3, 8), "2/b", 2)},
            timeout=180,
        )
        assert not [r for r in replies.values() if isinstance(r, grpc.RpcError)], replies
        assert "healed from a peer pod: version 0 -> 1" in b.log()
        alone = reference.stub.Train(batch, timeout=180)
        for reply in replies.values():
            assert reply.policy_version == 2
            _same_metrics(reply, alone)
        assert a.digest() == b.digest()
        assert max_abs_diff(b.parameters(tmp_path / "b"), reference.parameters(tmp_path / "r")) <= (
            TOLERANCE
        )
    finally:
        for pod in pods.values():
            pod.kill()
        lighthouse.stop()
