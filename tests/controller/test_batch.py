"""Score errors are not rewards: batch building leaves failed samples out."""

from __future__ import annotations

import pytest

from podrl.controller.step.batch import (
    StepSamples,
    TrainBatch,
    build_batch,
    check_score_errors,
    sample_id,
    split_batch,
    train_request,
)
from podrl.controller.step_errors import StepFailedError
from podrl.tasks import PromptItem
from podrl.v1 import common_pb2, grader_pb2, trainer_pb2

EXCEPTION = grader_pb2.SCORE_ERROR_EXCEPTION
FALLBACK = -1.0


def _step(groups: dict[str, list[tuple[float, int]]], task: str = "copy") -> StepSamples:
    """One prompt per key; each sample (reward, error). Failed samples carry the fallback."""
    data = StepSamples(items=[PromptItem(pid, task, f"p {pid}", "ref", "ref\n") for pid in groups])
    for pid, samples in groups.items():
        data.samples[pid] = [
            common_pb2.Sample(
                prompt_id=pid,
                index=i,
                prompt_token_ids=[1, 2],
                token_ids=[3, 4, 5],
                logprobs=[-0.1, -0.2, -0.3],
                policy_version=7,
            )
            for i in range(len(samples))
        ]
        for i, (reward, error) in enumerate(samples):
            data.scores[sample_id(pid, i)] = grader_pb2.ItemScore(
                id=sample_id(pid, i),
                reward=FALLBACK if error else reward,
                error=error,
                error_message="ValueError: the reward broke" if error else "",
            )
    return data


def test_failed_samples_are_left_out_and_advantages_use_the_valid_ones() -> None:
    data = _step(
        {
            "a": [(1.0, 0), (0.0, 0), (0.0, EXCEPTION), (1.0, 0)],
            "b": [(1.0, 0), (0.0, 0), (1.0, 0), (0.0, 0)],
        }
    )
    batch = build_batch(data, normalize_std=False, min_valid_per_group=2)
    trained = {s.sample_id: s.advantage for s in batch.sequences}
    assert "a#2" not in trained
    # Group a's baseline is the mean of its three valid rewards (2/3), not of four with the
    # fallback -1 in it (1/4): the failed sample changes no advantage.
    assert trained["a#0"] == pytest.approx(1 - 2 / 3)
    assert trained["a#1"] == pytest.approx(-2 / 3)
    assert len(trained) == 3 + 4
    assert batch.stats["score_errors"] == 1
    assert batch.stats["score_errors_by_kind"] == {"SCORE_ERROR_EXCEPTION": 1}
    assert batch.stats["dropped_samples"] == 1
    # Mean reward over the 7 validly scored samples; the fallback reward is not a reward.
    assert batch.stats["reward_mean"] == pytest.approx(4 / 7)
    assert batch.stats["reward_by_task"] == {"copy": pytest.approx(4 / 7)}
    assert batch.stats["reward_max"] == 1.0
    request = train_request(batch.sequences, batch, 7, "run:3:1")
    assert request.batch_id == "run:3:1" and request.policy_version == 7
    assert [s.sample_id for s in request.sequences] == [s.sample_id for s in batch.sequences]
    # The whole batch on one pod: its totals are its own.
    assert request.global_sequences == len(batch.sequences) and request.pods == 1


def test_a_group_left_with_too_few_valid_samples_is_dropped_whole() -> None:
    data = _step(
        {
            "a": [(1.0, 0), (0.0, EXCEPTION), (0.0, EXCEPTION), (0.0, EXCEPTION)],
            "b": [(1.0, 0), (0.0, 0), (0.0, EXCEPTION), (1.0, 0)],
            "c": [(1.0, 0), (0.0, 0), (1.0, 0), (0.0, 0)],
        }
    )
    batch = build_batch(data, normalize_std=True, min_valid_per_group=3)
    groups = {s.sample_id.split("#")[0] for s in batch.sequences}
    assert groups == {"b", "c"}
    assert batch.stats["groups_dropped_score_errors"] == 1
    assert batch.stats["groups_dropped"] == 1
    # a: all 4 (one valid sample, not enough); b: its failed one.
    assert batch.stats["dropped_samples"] == 4 + 1
    assert batch.stats["score_errors"] == 4
    assert batch.stats["sequences_trained"] == 3 + 4


def test_zero_variance_groups_are_counted_apart_from_score_errors() -> None:
    data = _step({"a": [(1.0, 0), (1.0, 0), (1.0, 0)], "b": [(1.0, 0), (0.0, 0), (1.0, 0)]})
    batch = build_batch(data, normalize_std=True, min_valid_per_group=2)
    assert batch.stats["groups_dropped"] == 1
    assert batch.stats["groups_dropped_score_errors"] == 0
    assert batch.stats["dropped_samples"] == 0
    assert batch.stats["sequences_trained"] == 3


def test_no_valid_sample_means_unknown_rewards_not_zero() -> None:
    data = _step({"a": [(0.0, EXCEPTION), (0.0, EXCEPTION)]})
    batch = build_batch(data, normalize_std=True, min_valid_per_group=2)
    assert batch.stats["reward_mean"] is None
    assert batch.stats["reward_max"] is None
    assert batch.sequences == []


def test_an_error_rate_above_the_limit_fails_the_attempt_with_the_rewards_message() -> None:
    data = _step({"a": [(1.0, 0), (0.0, EXCEPTION)], "b": [(1.0, EXCEPTION), (0.0, 0)]})
    check_score_errors(data, max_error_rate=0.5)  # 2 of 4: at the limit, allowed
    with pytest.raises(StepFailedError) as failed:
        check_score_errors(data, max_error_rate=0.49)
    assert failed.value.phase == "score"
    message = str(failed.value)
    assert "2 of 4 samples failed scoring" in message
    assert "loop.max_score_error_rate" in message
    assert "SCORE_ERROR_EXCEPTION: ValueError: the reward broke" in message
    assert "a#1" in message


def test_every_sample_failing_fails_the_attempt_whatever_the_limit() -> None:
    data = _step({"a": [(0.0, EXCEPTION), (0.0, EXCEPTION)]})
    with pytest.raises(StepFailedError, match="every sample failed"):
        check_score_errors(data, max_error_rate=1.0)


def test_no_score_errors_pass() -> None:
    check_score_errors(_step({"a": [(1.0, 0), (0.0, 0)]}), max_error_rate=0.0)


def _sequences(groups: dict[str, list[int]]) -> list[trainer_pb2.TrainSequence]:
    """One sequence per entry: prompt id → completion lengths of its group's samples."""
    return [
        trainer_pb2.TrainSequence(sample_id=f"{pid}#{i}", completion_ids=[1] * length)
        for pid, lengths in groups.items()
        for i, length in enumerate(lengths)
    ]


def test_a_split_keeps_groups_whole_and_balances_tokens() -> None:
    sequences = _sequences({"a": [8, 8], "b": [2, 2], "c": [3, 3], "d": [1, 1]})
    shares = split_batch(sequences, ["pod-0", "pod-1"])
    prompts = {pod: {s.sample_id.split("#")[0] for s in share} for pod, share in shares.items()}
    # a (16 tokens) on pod-0; b, c and d (12) on pod-1: no group is cut.
    assert prompts == {"pod-0": {"a"}, "pod-1": {"b", "c", "d"}}
    together = sorted(s.sample_id for share in shares.values() for s in share)
    assert together == sorted(s.sample_id for s in sequences)


def test_a_pod_may_get_an_empty_share_and_every_request_carries_the_totals() -> None:
    sequences = _sequences({"a": [2, 3]})
    batch = TrainBatch(sequences, {})
    shares = split_batch(sequences, ["pod-0", "pod-1", "pod-2"])
    assert [len(shares[p]) for p in ("pod-0", "pod-1", "pod-2")] == [2, 0, 0]
    requests = [train_request(shares[p], batch, 4, f"b@{p}", pods=3) for p in shares]
    assert {(r.global_sequences, r.global_completion_tokens, r.pods) for r in requests} == {
        (2, 5, 3)
    }
    assert sum(len(r.sequences) for r in requests) == 2


def test_a_sample_spanning_versions_is_judged_by_its_oldest() -> None:
    """A group sampled from version 5 on, finished under 7 (an in-flight update): at version 7
    with max_staleness 1 it is 2 versions old, so dropped; the one from 6 to 7 is kept and
    its samples counted as spanning versions. A generator without in-flight applies leaves
    last_policy_version 0: read as policy_version."""
    from podrl.controller.step.batch import last_version, split_stale

    data = _step({"old": [(1.0, 0), (0.0, 0)], "mid": [(1.0, 0), (0.0, 0)], "one": [(1.0, 0)]})
    for pid, (first, last) in {"old": (5, 7), "mid": (6, 7), "one": (7, 0)}.items():
        for sample in data.samples[pid]:
            sample.policy_version, sample.last_policy_version = first, last
    split = split_stale(data, current_version=7, max_staleness=1)
    assert split.stale == ["old"]
    assert split.staleness == {"old": 2, "mid": 1, "one": 0}
    assert split.figures()["samples_spanning_versions"] == 2
    assert last_version(data.samples["one"][0]) == 7


def test_equal_reward_groups_can_be_trained_at_advantage_0_as_trl_does() -> None:
    """loop.keep_equal_reward_groups: the group counts in the loss's normaliser; its advantages
    are 0, so it adds no gradient; the other groups' advantages are unchanged."""
    data = _step({"a": [(1.0, 0), (1.0, 0), (1.0, 0)], "b": [(1.0, 0), (0.0, 0), (1.0, 0)]})
    dropped = build_batch(data, normalize_std=True, min_valid_per_group=2)
    kept = build_batch(
        data, normalize_std=True, min_valid_per_group=2, keep_equal_reward_groups=True
    )
    assert [s.sample_id for s in kept.sequences] == ["a#0", "a#1", "a#2"] + [
        s.sample_id for s in dropped.sequences
    ]
    assert [s.advantage for s in kept.sequences[:3]] == [0.0, 0.0, 0.0]
    assert [s.advantage for s in kept.sequences[3:]] == [s.advantage for s in dropped.sequences]
    assert (kept.stats["groups_dropped"], dropped.stats["groups_dropped"]) == (0, 1)
    assert kept.stats["groups_equal_reward"] == dropped.stats["groups_equal_reward"] == 1
    assert kept.stats["sequences_trained"] == 6
