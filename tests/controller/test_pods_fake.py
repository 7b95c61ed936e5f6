"""The loop over several worker pods, against fake pods (trainer and generator stand-ins over
real gRPC, tests/controller/fake_workers.py, whose trainers form a FakeReplicaGroup: the
cross-pod contract of the real ones) and the REAL grader.

Each test runs ``GrpoLoop.run`` to its end and checks what the run left behind: every step
trained once, each prompt in one step and one pod, the pods' fake parameters equal (and equal
to one pod's on the same batches), and what the records say (epoch, pods, samples' pods).
"""

from __future__ import annotations

from pathlib import Path

from podrl.v1 import controller_pb2
from tests.controller.fake_cluster import (
    STEPS,
    Cluster,
    check_every_prompt_once,
    digest,
)
from tests.controller.fake_pod_loop import PROMPTS
from tests.controller.fake_workers import FakePod


def test_two_pods_share_each_step_and_end_with_the_parameters_of_one_pod(
    cluster: Cluster, tmp_path: Path, grader_address: str
) -> None:
    pods = [cluster.add("pod-0"), cluster.add("pod-1")]
    run = cluster.run()
    assert run["state"].phase == "finished", run["state"].error
    assert [s.step for s in run["steps"]] == [1, 2, 3]
    for record in run["steps"]:
        assert record.metrics["pods"] == ["pod-0", "pod-1"]
        assert record.metrics["epoch"] == 1
        assert set(record.metrics["generated_by"]) == {"pod-0", "pod-1"}
    for pod in pods:
        # Each trainer trained its share of every step, and the pods' shares make the batch.
        assert len(pod.trainer.applied) == STEPS and pod.trainer.version == STEPS
        assert pod.generator.version == STEPS
        assert 0 < len(pod.generator.generated) < STEPS * PROMPTS
        # Weight sync stayed inside the pod: each generator applied its own trainer's manifests.
        assert {m.publisher_id for m in pod.generator.applied} == {pod.id}
    for step in range(STEPS):
        shares = [{s.sample_id for s in pod.trainer.applied[step].sequences} for pod in pods]
        assert not shares[0] & shares[1]
        totals = {pod.trainer.applied[step].global_sequences for pod in pods}
        assert totals == {len(shares[0] | shares[1])}
        assert {pod.trainer.applied[step].pods for pod in pods} == {2}
        # The step's pods by worker id: a trainer refuses a quorum holding any other pod.
        assert {tuple(pod.trainer.applied[step].pod_ids) for pod in pods} == {("pod-0", "pod-1")}
    digests = {digest(pod.address).sha256 for pod in pods}
    assert len(digests) == 1
    check_every_prompt_once(run["samples"], STEPS)
    assert {row["pod"] for row in run["samples"]} == {"pod-0", "pod-1"}

    # One pod on the same prompts (the fake generator answers by prompt, so the same batches)
    # ends with the same parameters: the pods' update is the 1-pod update.
    alone = Cluster(tmp_path / "alone", grader_address, None)
    alone.add("pod-0")
    try:
        one = alone.run()
        assert one["state"].phase == "finished", one["state"].error
        assert digest(alone.pods["pod-0"].address).sha256 in digests
    finally:
        alone.stop()


def test_a_pod_that_registers_mid_run_joins_at_the_next_step_and_heals(
    cluster: Cluster,
) -> None:
    cluster.add("pod-0")
    joined: dict[str, FakePod] = {}

    def after_step(step: int) -> None:
        if step == 1:
            joined["pod"] = cluster.add("pod-1")

    run = cluster.run(steps=4, on_step=after_step)
    assert run["state"].phase == "finished", run["state"].error
    new = joined["pod"]
    records = {s.step: s.metrics for s in run["steps"]}
    assert records[1]["pods"] == ["pod-0"] and records[1]["epoch"] == 1
    # Step 2: admitted; it trains (healing first) but does not generate (its generator has no
    # current weights until its trainer healed and synced it).
    assert records[2]["pods"] == ["pod-0", "pod-1"] and records[2]["epoch"] == 2
    assert set(records[2]["generated_by"]) == {"pod-0"}
    assert new.trainer.applied[0].policy_version == 1  # sent the cluster's version, healed
    assert new.generator.applied[0].version == 2 and not new.generator.applied[0].version_only
    assert set(records[3]["generated_by"]) == {"pod-0", "pod-1"}
    assert new.trainer.version == cluster.pods["pod-0"].trainer.version == 4
    assert digest(new.address).sha256 == digest(cluster.pods["pod-0"].address).sha256
    check_every_prompt_once(run["samples"], 4)


def test_a_pod_killed_mid_train_leaves_and_the_step_is_trained_once_by_the_rest(
    cluster: Cluster,
) -> None:
    pods = [cluster.add("pod-0"), cluster.add("pod-1"), cluster.add("pod-2")]
    victim = pods[1]

    def kill_in_step_2(step: int) -> None:
        if step == 1:
            cluster.group.before_exchange.append(victim.kill)

    run = cluster.run(on_step=kill_in_step_2)
    assert run["state"].phase == "finished", run["state"].error
    records = {s.step: s.metrics for s in run["steps"]}
    assert records[1]["pods"] == ["pod-0", "pod-1", "pod-2"] and records[1]["epoch"] == 1
    # Step 2: the killed pod's exchange broke every trainer's step (ABORTED, nothing changed);
    # the batch was re-split over the two left and trained once.
    assert records[2]["pods"] == ["pod-0", "pod-2"] and records[2]["epoch"] == 2
    assert records[2]["train_sends"] == 2
    for pod in (pods[0], pods[2]):
        assert pod.trainer.version == STEPS and len(pod.trainer.applied) == STEPS
    second = [pod.trainer.applied[1] for pod in (pods[0], pods[2])]
    assert {r.pods for r in second} == {2}
    assert sum(len(r.sequences) for r in second) == second[0].global_sequences
    assert digest(pods[0].address).sha256 == digest(pods[2].address).sha256
    check_every_prompt_once(run["samples"], STEPS)
    # Its samples of step 2 (generated before it died) were kept and trained by the others.
    assert any(
        row["pod"] == "pod-1" and row["trained"] for row in run["samples"] if row["step"] == 2
    )
    assert "pod-1" not in {row["pod"] for row in run["samples"] if row["step"] == 3}


def test_a_pod_drained_mid_generate_keeps_its_samples_and_the_others_finish_its_share(
    cluster: Cluster,
) -> None:
    pods = [cluster.add("pod-0"), cluster.add("pod-1")]
    drained = pods[1]
    generate_calls = {"n": 0}

    def drain_on_second_generate() -> None:
        generate_calls["n"] += 1
        if generate_calls["n"] == 2:  # step 2: its Generate still answers (in-flight RPCs finish)
            cluster.drain("pod-1")

    drained.generator.on_generate = drain_on_second_generate
    run = cluster.run()
    assert run["state"].phase == "finished", run["state"].error
    records = {s.step: s.metrics for s in run["steps"]}
    # Its samples of step 2 are kept (generated by it, scored and trained by pod-0); it trains
    # nothing from step 2 on.
    assert records[2]["generated_by"] == {"pod-0": PROMPTS - PROMPTS // 2, "pod-1": PROMPTS // 2}
    assert records[2]["pods"] == ["pod-0"] and records[2]["epoch"] == 2
    assert len(drained.trainer.applied) == 1
    kept = [r for r in run["samples"] if r["step"] == 2 and r["pod"] == "pod-1"]
    assert kept and all(r["trained"] or r["reward"] is not None for r in kept)
    check_every_prompt_once(run["samples"], STEPS)
    status = {p.id: p.state for p in run["table"].status()}
    assert status == {"pod-0": "training", "pod-1": "draining"}


def test_a_pod_killed_mid_generate_has_its_prompts_generated_by_the_others(
    cluster: Cluster,
) -> None:
    pods = [cluster.add("pod-0"), cluster.add("pod-1")]
    victim = pods[0]
    calls = {"n": 0}

    def die_on_second_generate() -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            victim.kill()  # the call in flight breaks; nothing of this call comes back

    victim.generator.on_generate = die_on_second_generate
    run = cluster.run()
    assert run["state"].phase == "finished", run["state"].error
    records = {s.step: s.metrics for s in run["steps"]}
    assert records[2]["generated_by"] == {"pod-1": PROMPTS}
    assert records[2]["pods"] == ["pod-1"]
    check_every_prompt_once(run["samples"], STEPS)
    assert pods[1].trainer.version == STEPS


def test_a_trainer_whose_generator_left_is_still_sent_every_step(cluster: Cluster) -> None:
    """torchft: a trainer that heartbeats to the Lighthouse but is not sent a step holds the
    other pods' quorum; so while it is healthy it gets every step (its pod generates nothing)."""
    pods = [cluster.add("pod-0"), cluster.add("pod-1")]
    calls = {"n": 0}

    def generator_leaves() -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # step 2: only pod-1's generator drains
            cluster.table.drain("pod-1", controller_pb2.COMPONENT_GENERATOR, "pod-1-incarnation")

    pods[1].generator.on_generate = generator_leaves
    run = cluster.run()
    assert run["state"].phase == "finished", run["state"].error
    records = {s.step: s.metrics for s in run["steps"]}
    assert records[3]["generated_by"] == {"pod-0": PROMPTS}
    assert records[3]["pods"] == ["pod-0", "pod-1"]
    assert pods[1].trainer.version == pods[0].trainer.version == STEPS
    assert {r.pods for r in pods[0].trainer.applied} == {2}
    assert digest(pods[0].address).sha256 == digest(pods[1].address).sha256
    check_every_prompt_once(run["samples"], STEPS)
