"""Asynchronous mode (``loop.mode: async``) against fake pods over real gRPC and the REAL
grader (tests/controller/fake_workers.py, the Cluster of tests/controller/fake_cluster.py).

Each test runs ``GrpoLoop.run`` to its end and checks what the run left behind: from
``samples.jsonl`` and the step records, no trained sample is older than ``max_staleness``
versions; with ``max_staleness`` 0 the run is the synchronous run step for step; every prompt
is trained in exactly one step (none skipped, none twice) through drains, kills and a restart.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.controller.fake_cluster import Cluster, check_every_prompt_once, digest
from tests.controller.fake_pod_loop import GROUP, PROMPTS
from tests.controller.fake_workers import FakePod, FakeReplicaGroup

STEPS = 6
TRAIN_SECONDS = 0.25
"""Each fake Train takes this long: the producer generates the next batches meanwhile."""


def _slow(pod: FakePod) -> FakePod:
    pod.trainer.train_seconds = TRAIN_SECONDS
    return pod


def _staleness_of_trained(run: dict[str, Any]) -> list[int]:
    """For every trained sample row: the version its step trained at (the step record's
    version minus one) minus the version that sampled it."""
    records = {s.step: s for s in run["steps"]}
    lags = []
    for row in run["samples"]:
        if row["trained"]:
            record = records[row["step"]]
            assert record.metrics["trained"]
            lags.append(record.policy_version - 1 - row["policy_version"])
    return lags


def _metric(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_no_trained_sample_is_older_than_max_staleness(
    cluster: Cluster, max_staleness: int
) -> None:
    pods = [_slow(cluster.add("pod-0")), _slow(cluster.add("pod-1"))]
    run = cluster.run(steps=STEPS, mode="async", max_staleness=max_staleness)
    assert run["state"].phase == "finished", run["state"].error
    assert [s.step for s in run["steps"]] == list(range(1, STEPS + 1))
    lags = _staleness_of_trained(run)
    assert len(lags) == STEPS * PROMPTS * 4  # every sample trained (each group has variance)
    assert min(lags) >= 0 and max(lags) <= max_staleness
    # The producer ran ahead: batches were sampled by older versions while the trainers trained
    # (with fake generators that take no time, exactly max_staleness behind from then on).
    assert max(lags) == max_staleness
    for record in run["steps"]:
        histogram = record.metrics["staleness_histogram"]
        assert sum(histogram.values()) == PROMPTS
        assert all(int(lag) <= max_staleness for lag in histogram)
        assert record.metrics["groups_dropped_stale"] == 0
    for pod in pods:
        assert pod.trainer.version == STEPS and len(pod.trainer.applied) == STEPS
        assert pod.generator.version == STEPS
        assert pod.generator.overlaps == 0  # weights applied between generation batches only
        # Each trained sequence carries the version that sampled it and that generator's own
        # logprobs: the trainer's importance ratio is against the behaviour policy.
        for request in pod.trainer.applied:
            for sequence in request.sequences:
                assert request.policy_version - max_staleness <= sequence.policy_version
                assert sequence.policy_version <= request.policy_version
                assert list(sequence.generator_logprobs) == [-0.5] * len(sequence.completion_ids)
    sent = [
        s.policy_version < r.policy_version
        for p in pods
        for r in p.trainer.applied
        for s in r.sequences
    ]
    assert any(sent)
    # Each step record has its trained samples' behaviour-policy age: the trainers' version
    # minus the (oldest) version that sampled each.
    for index, record in enumerate(run["steps"]):
        ages = [
            p.trainer.applied[index].policy_version - s.policy_version
            for p in pods
            for s in p.trainer.applied[index].sequences
        ]
        assert record.metrics["behaviour_age_max"] == max(ages)
        assert record.metrics["behaviour_age_mean"] == pytest.approx(sum(ages) / len(ages))
    assert max(r.metrics["behaviour_age_max"] for r in run["steps"]) == max_staleness
    assert len({digest(pod.address).sha256 for pod in pods}) == 1
    check_every_prompt_once(run["samples"], STEPS)
    # The status page says so too.
    rollout = run["state"].view().rollout
    assert rollout.mode == "async" and rollout.max_staleness == max_staleness
    assert rollout.buffer_capacity_groups == (max_staleness + 1) * PROMPTS
    assert sum(rollout.staleness_histogram.values()) == STEPS * PROMPTS
    assert rollout.staleness_histogram[str(max_staleness)] > 0


def test_the_trainers_publish_during_a_batch_and_the_generators_apply_after_it(
    cluster: Cluster,
) -> None:
    # As on the CPU demo, generating a batch takes longer than training a step: the weight
    # sync's publish (the trainers' work) overlaps the producer's batch; only ApplyWeights
    # waits for the batch to end.
    pod = cluster.add("pod-0")
    pod.generator.generate_seconds = 0.3
    pod.trainer.train_seconds = 0.05
    run = cluster.run(steps=STEPS, mode="async", max_staleness=1)
    assert run["state"].phase == "finished", run["state"].error
    assert any(pod.trainer.published_while_generating)
    assert pod.generator.overlaps == 0
    assert max(_staleness_of_trained(run)) <= 1
    check_every_prompt_once(run["samples"], STEPS)


def test_in_flight_weight_updates_land_mid_batch_and_samples_record_both_versions(
    cluster: Cluster,
) -> None:
    """loop.weight_apply: in_flight: each sync is applied while the producer's batch runs (no
    gate), the samples it interrupted record both versions, and staleness is judged by the
    older one; nothing is lost or trained twice."""
    pod = cluster.add("pod-0")
    pod.generator.generate_seconds = 0.3
    pod.trainer.train_seconds = 0.05
    run = cluster.run(steps=STEPS, mode="async", max_staleness=1, weight_apply="in_flight")
    assert run["state"].phase == "finished", run["state"].error
    assert pod.generator.applied_in_flight and all(pod.generator.applied_in_flight)
    assert pod.generator.overlaps > 0  # applied in the middle of a batch
    records = {record.step: record for record in run["steps"]}
    spanning = []
    for row in run["samples"]:
        trained_at = records[row["step"]].policy_version - 1
        assert row["policy_version"] <= row["last_policy_version"] <= trained_at
        if row["last_policy_version"] > row["policy_version"]:
            spanning.append(row)
    assert spanning, "no sample spanned two versions"
    assert max(_staleness_of_trained(run)) <= 1  # by the oldest version of each sample
    figures = [record.metrics["samples_spanning_versions"] for record in run["steps"]]
    assert sum(figures) == len(spanning)
    rollout = run["state"].view().rollout
    assert rollout.weight_apply == "in_flight"
    assert rollout.samples_spanning_versions == len(spanning)
    check_every_prompt_once(run["samples"], STEPS)


def test_between_batches_no_sample_spans_versions(cluster: Cluster) -> None:
    pod = cluster.add("pod-0")
    pod.generator.generate_seconds = 0.3
    pod.trainer.train_seconds = 0.05
    run = cluster.run(steps=STEPS, mode="async", max_staleness=1)
    assert run["state"].phase == "finished", run["state"].error
    assert not any(pod.generator.applied_in_flight) and pod.generator.overlaps == 0
    assert all(row["last_policy_version"] == row["policy_version"] for row in run["samples"])
    assert all(record.metrics["samples_spanning_versions"] == 0 for record in run["steps"])


def _by_step(run: dict[str, Any]) -> list[tuple[int, str, int, bool]]:
    return sorted(
        (row["step"], row["prompt_id"], row["policy_version"], row["trained"])
        for row in run["samples"]
        if row["index"] == 0
    )


def test_max_staleness_zero_is_the_synchronous_run_step_for_step(
    tmp_path: Path,
    grader_address: str,
) -> None:
    runs, pods = {}, {}
    for mode, loop in (("sync", {}), ("async", {"mode": "async", "max_staleness": 0})):
        cluster = Cluster(tmp_path / mode, grader_address, FakeReplicaGroup())
        pods[mode] = [_slow(cluster.add("pod-0")), _slow(cluster.add("pod-1"))]
        try:
            runs[mode] = cluster.run(steps=4, sampling={"n": GROUP, "seed": 7}, **loop)
        finally:
            cluster.stop()
        assert runs[mode]["state"].phase == "finished", runs[mode]["state"].error
    # Same prompts in the same steps, sampled by the same versions, on the same pods.
    assert _by_step(runs["sync"]) == _by_step(runs["async"])
    assert {(r["step"], r["prompt_id"], r["pod"]) for r in runs["sync"]["samples"]} == {
        (r["step"], r["prompt_id"], r["pod"]) for r in runs["async"]["samples"]
    }
    assert all(row["policy_version"] == row["step"] - 1 for row in runs["async"]["samples"])
    for sync_pod, async_pod in zip(pods["sync"], pods["async"], strict=True):
        # The same batches trained at the same versions, so the same parameters.
        assert [
            (r.policy_version, sorted((s.sample_id, round(s.advantage, 6)) for s in r.sequences))
            for r in sync_pod.trainer.applied
        ] == [
            (r.policy_version, sorted((s.sample_id, round(s.advantage, 6)) for s in r.sequences))
            for r in async_pod.trainer.applied
        ]
        assert sync_pod.trainer.digest == async_pod.trainer.digest
        assert sync_pod.generator.generated == async_pod.generator.generated
    for sync_step, async_step in zip(runs["sync"]["steps"], runs["async"]["steps"], strict=True):
        assert sync_step.policy_version == async_step.policy_version
        assert sync_step.position_after == async_step.position_after


def test_groups_older_than_max_staleness_are_dropped_and_counted(cluster: Cluster) -> None:
    """A generator that missed syncs samples two prompts with version 0: when their steps
    train (at versions 3 and 4) those groups are 3 and 4 versions old, more than 1."""
    pod = _slow(cluster.add("pod-0"))
    old = {"copy/10", "copy/13"}  # in steps 4 and 5 (3 prompts per step)
    pod.generator.version_of = lambda prompt_id, version: 0 if prompt_id in old else version
    groups_before = _metric("podrl_stale_groups_dropped_total")
    samples_before = _metric("podrl_stale_samples_dropped_total")
    run = cluster.run(steps=5, mode="async", max_staleness=1)
    assert run["state"].phase == "finished", run["state"].error
    records = {s.step: s.metrics for s in run["steps"]}
    for step in (4, 5):
        assert records[step]["groups_dropped_stale"] == 1
        assert records[step]["samples_dropped_stale"] == 4
        assert records[step]["groups"] == PROMPTS and records[step]["groups_dropped"] == 1
        assert records[step]["sequences_trained"] == (PROMPTS - 1) * 4
    assert sum(r["groups_dropped_stale"] for r in records.values()) == 2
    rows = [row for row in run["samples"] if row["prompt_id"] in old]
    assert len(rows) == 8 and not any(row["trained"] for row in rows)
    assert max(_staleness_of_trained(run)) <= 1
    # Never sent to a trainer.
    sent = {s.sample_id.split("#")[0] for r in pod.trainer.applied for s in r.sequences}
    assert not sent & old
    rollout = run["state"].view().rollout
    assert rollout.groups_dropped_stale == 2 and rollout.samples_dropped_stale == 8
    assert _metric("podrl_stale_groups_dropped_total") - groups_before == 2
    assert _metric("podrl_stale_samples_dropped_total") - samples_before == 8


def test_a_restart_continues_after_the_last_recorded_step_with_the_buffer_drawn_again(
    cluster: Cluster,
) -> None:
    """The producer drew the prompts of two steps ahead; the run stops after step 3: a new
    controller continues at step 4 with exactly the prompts after step 3's."""
    pod = _slow(cluster.add("pod-0"))
    stop = threading.Event()

    def stop_after_3(step: int) -> None:
        if step == 3:
            stop.set()

    first = cluster.run(steps=STEPS, on_step=stop_after_3, stop=stop, mode="async", max_staleness=2)
    assert first["state"].phase == "stopped", first["state"].error
    assert [s.step for s in first["steps"]] == [1, 2, 3]
    drawn = len(set(pod.generator.generated))
    assert drawn > 3 * PROMPTS  # the buffer held prompts of later steps
    second = cluster.run(steps=STEPS, mode="async", max_staleness=2)
    assert second["state"].phase == "finished", second["state"].error
    assert [s.step for s in second["steps"]] == list(range(1, STEPS + 1))
    assert pod.trainer.version == STEPS and len(pod.trainer.applied) == STEPS
    trained = [
        row["prompt_id"] for row in second["samples"] if row["trained"] and row["index"] == 0
    ]
    assert trained == [f"copy/{i}" for i in range(STEPS * PROMPTS)]  # none skipped or twice
    check_every_prompt_once(second["samples"], STEPS)
    assert max(_staleness_of_trained(second)) <= 2


def test_a_pod_killed_mid_train_in_async_mode_leaves_and_the_step_is_trained_once(
    cluster: Cluster,
) -> None:
    pods = [_slow(cluster.add(f"pod-{i}")) for i in range(3)]
    victim = pods[1]

    def kill_in_step_3(step: int) -> None:
        if step == 2:
            cluster.group.before_exchange.append(victim.kill)

    run = cluster.run(steps=5, on_step=kill_in_step_3, mode="async", max_staleness=1)
    assert run["state"].phase == "finished", run["state"].error
    records = {s.step: s.metrics for s in run["steps"]}
    assert records[3]["pods"] == ["pod-0", "pod-2"] and records[3]["train_sends"] == 2
    for pod in (pods[0], pods[2]):
        assert pod.trainer.version == 5 and len(pod.trainer.applied) == 5
    assert digest(pods[0].address).sha256 == digest(pods[2].address).sha256
    check_every_prompt_once(run["samples"], 5)
    assert max(_staleness_of_trained(run)) <= 1


def test_a_pod_drained_in_async_mode_keeps_its_samples_and_nothing_is_lost(
    cluster: Cluster,
) -> None:
    pods = [_slow(cluster.add("pod-0")), _slow(cluster.add("pod-1"))]
    calls = {"n": 0}

    def drain_on_third_generate() -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            cluster.drain("pod-1")

    pods[1].generator.on_generate = drain_on_third_generate
    run = cluster.run(steps=5, mode="async", max_staleness=1)
    assert run["state"].phase == "finished", run["state"].error
    assert pods[0].trainer.version == 5
    assert run["steps"][-1].metrics["pods"] == ["pod-0"]
    # What the drained pod generated before it left was kept and trained by pod-0.
    assert any(row["pod"] == "pod-1" and row["trained"] for row in run["samples"])
    check_every_prompt_once(run["samples"], 5)
    assert max(_staleness_of_trained(run)) <= 1


def test_a_failed_generate_in_async_mode_is_retried_with_the_same_prompts(
    cluster: Cluster,
) -> None:
    pod = _slow(cluster.add("pod-0"))
    calls = {"n": 0}

    def fail_second_generate() -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected generator failure")  # UNKNOWN: not a lost pod

    pod.generator.on_generate = fail_second_generate
    failures = REGISTRY.get_sample_value("podrl_step_failures_total", {"phase": "generate"}) or 0
    run = cluster.run(steps=4, mode="async", max_staleness=1)
    assert run["state"].phase == "finished", run["state"].error
    after = REGISTRY.get_sample_value("podrl_step_failures_total", {"phase": "generate"}) or 0
    assert after - failures == 1
    # The failed call generated nothing; the retry asked for step 2's prompts again, in order.
    assert pod.generator.generated == [f"copy/{i}" for i in range(4 * PROMPTS)]
    assert pod.trainer.version == 4
    check_every_prompt_once(run["samples"], 4)


def test_a_group_newer_than_the_trainers_fails_the_run(cluster: Cluster) -> None:
    pod = cluster.add("pod-0")
    pod.generator.version_of = lambda prompt_id, version: (
        version + (5 if prompt_id == "copy/4" else 0)
    )
    run = cluster.run(steps=3, mode="async", max_staleness=1)
    assert run["state"].phase == "failed"
    error = run["state"].error
    assert "step 2: generate: prompt copy/4: sampled by policy version" in error
    assert "newer than the trainers' 1" in error and "restart the run" in error
    assert pod.trainer.version == 1  # step 2 never trained


@pytest.mark.parametrize("weight_apply", ["between_batches", "in_flight"])
def test_evaluations_wait_for_the_producers_batch_and_hold_it_back(
    cluster: Cluster, weight_apply: str
) -> None:
    """Held-out evaluations (greedy, on the generators) take the generator gate as a weight
    sync does: never during one of the producer's Generate calls, and evaluate the version the
    trainers hold. With in-flight weight updates the syncs land mid-batch, evaluations still
    wait."""
    pods = [cluster.add("pod-0"), cluster.add("pod-1")]
    for pod in pods:
        # Generation slower than training: the producer is mid-batch whenever a step ends, so
        # an evaluation that did not wait for it would run a Generate alongside.
        pod.generator.generate_seconds = 0.4
        pod.trainer.train_seconds = 0.05
    run = cluster.run(
        steps=4,
        mode="async",
        max_staleness=2,
        eval_prompts=4,
        eval_every=2,
        task={"split": {"eval": 0.3}},
        weight_apply=weight_apply,
    )
    assert run["state"].phase == "finished", run["state"].error
    evals = run["state"].view()
    assert evals.evaluations == 3  # before step 1, after step 2, after step 4
    for pod in pods:
        assert pod.generator.max_running == 1  # no evaluation Generate beside the producer's
        assert (pod.generator.overlaps > 0) == (weight_apply == "in_flight")
    assert max(_staleness_of_trained(run)) <= 2


def test_a_pod_that_joins_in_async_mode_heals_and_generates_only_with_current_weights(
    cluster: Cluster,
) -> None:
    _slow(cluster.add("pod-0"))
    joined: dict[str, FakePod] = {}

    def after_step(step: int) -> None:
        if step == 1:
            joined["pod"] = _slow(cluster.add("pod-1"))

    run = cluster.run(steps=5, on_step=after_step, mode="async", max_staleness=1)
    assert run["state"].phase == "finished", run["state"].error
    new = joined["pod"]
    records = {s.step: s.metrics for s in run["steps"]}
    assert records[1]["pods"] == ["pod-0"]
    assert records[3]["pods"] == ["pod-0", "pod-1"]
    # Its generator got a full manifest after its trainer healed, before it generated anything;
    # everything it sampled carries a version it was synced to.
    first = new.generator.applied[0]
    assert not first.version_only and first.version >= 2
    rows = [row for row in run["samples"] if row["pod"] == "pod-1"]
    assert rows and min(row["policy_version"] for row in rows) >= first.version
    assert new.trainer.version == cluster.pods["pod-0"].trainer.version == 5
    assert digest(new.address).sha256 == digest(cluster.pods["pod-0"].address).sha256
    check_every_prompt_once(run["samples"], 5)
    assert max(_staleness_of_trained(run)) <= 1
