"""loop.sampling.seed: the seed the controller derives for each prompt of each step
(``prompt_seed``), and runs over fake pods whose generator samples from that seed as vLLM does
(sample i from ``seed + i``): the same seed writes the same samples.jsonl completions, across
pod counts and a resume; another seed writes others; no seed sends none."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from podrl.config.loop import LoopConfig
from podrl.controller.step.pod_calls import PROMPT_SEED_BITS, prompt_seed
from podrl.v1 import common_pb2
from tests.controller.fake_cluster import Cluster
from tests.controller.fake_pod_loop import GROUP
from tests.controller.fake_workers import FakeReplicaGroup

STEPS = 4


def test_prompt_seed_is_the_top_62_bits_of_the_sha256_of_seed_step_and_prompt_id() -> None:
    # sha256(b"7:3:copy-12") begins 0xfa961a39b115b48b; shifted right by 2 bits:
    assert hashlib.sha256(b"7:3:copy-12").hexdigest()[:16] == "fa961a39b115b48b"
    assert prompt_seed(7, 3, "copy-12") == 0xFA961A39B115B48B >> 2 == 4514162147768757538
    assert prompt_seed(0, 1, "p") == int(hashlib.sha256(b"0:1:p").hexdigest()[:16], 16) >> 2


def test_prompt_seeds_differ_across_prompts_steps_and_run_seeds_and_leave_room_for_n() -> None:
    seeds = {
        prompt_seed(seed, step, f"copy-{i}")
        for seed in (0, 1)
        for step in range(1, 51)
        for i in range(16)
    }
    assert len(seeds) == 2 * 50 * 16
    # seed + step would give run 0's step 2 the seeds of run 1's step 1.
    assert prompt_seed(0, 2, "copy-0") != prompt_seed(1, 1, "copy-0")
    # vLLM seeds sample i with seed + i (n ≤ 1024): that stays a signed 64-bit integer.
    assert max(seeds) + 1023 < 2**63 and PROMPT_SEED_BITS == 62


def test_the_field_of_earlier_versions_names_its_new_place() -> None:
    with pytest.raises(ValidationError, match=r"loop\.sample_seed is now loop\.sampling\.seed"):
        LoopConfig.model_validate({"sample_seed": 3})
    assert LoopConfig.model_validate({"sampling": {"seed": 3}}).sampling.seed == 3
    assert LoopConfig().sampling.seed is None


class SeededGenerator:
    """A fake generator's answers drawn as vLLM draws them: sample i from ``seed + i`` of the
    prompt's seed, from fresh randomness without one; notes the seeds it was sent."""

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    def __call__(self, prompt: common_pb2.Prompt, index: int) -> str:
        if index == 0:
            self.seeds.append(prompt.seed if prompt.HasField("seed") else None)
        rng = random.Random(prompt.seed + index) if prompt.HasField("seed") else random.Random()
        return prompt.reference if rng.random() < 0.5 else f"wrong {rng.randrange(10**9)}"


def _cluster(tmp_path: Path, grader: str, name: str, pods: int) -> tuple[Cluster, SeededGenerator]:
    cluster = Cluster(tmp_path / name, grader, FakeReplicaGroup() if pods > 1 else None)
    sampler = SeededGenerator()
    for i in range(pods):
        cluster.add(f"pod-{i}").generator.complete = sampler
    return cluster, sampler


def _completions(run: dict[str, Any]) -> dict[tuple[int, str, int], str]:
    assert run["state"].phase == "finished", run["state"].error
    return {(r["step"], r["prompt_id"], r["index"]): r["completion"] for r in run["samples"]}


def test_runs_with_one_seed_write_the_same_completions_on_any_pod_count_and_across_a_resume(
    tmp_path: Path, grader_address: str
) -> None:
    sampling = {"n": GROUP, "seed": 7}
    quiet = {"export_at_end": False}  # the fake trainers export nothing
    one, _ = _cluster(tmp_path, grader_address, "one", 1)
    two, _ = _cluster(tmp_path, grader_address, "two", 2)
    other, _ = _cluster(tmp_path, grader_address, "other", 1)
    unseeded, sent = _cluster(tmp_path, grader_address, "unseeded", 1)
    try:
        reference = _completions(one.run(steps=STEPS, sampling=sampling, **quiet))
        # Two pods, stopped after step 2 and resumed: each prompt on whichever pod, same samples.
        _completions(two.run(steps=2, sampling=sampling, **quiet))
        resumed = two.run(steps=STEPS, sampling=sampling, **quiet)
        assert {row["pod"] for row in resumed["samples"]} == {"pod-0", "pod-1"}
        assert _completions(resumed) == reference
        assert len(reference) == STEPS * 3 * GROUP  # every step's samples were compared
        differ = _completions(other.run(steps=STEPS, sampling={"n": GROUP, "seed": 8}, **quiet))
        assert differ.keys() == reference.keys() and differ != reference
        _completions(unseeded.run(steps=1, **quiet))
        assert sent.seeds and set(sent.seeds) == {None}
    finally:
        for cluster in (one, two, other, unseeded):
            cluster.stop()
