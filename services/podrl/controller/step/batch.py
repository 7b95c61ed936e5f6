"""From one step's samples and scores to the batch the trainer gets.

Pure: no RPC, no clock. The rules (docs/controller.md, "Score errors"):

- a sample whose ``ItemScore.error`` is not ``SCORE_ERROR_NONE`` never reaches the trainer and
  its (fallback) reward is not counted in any reward figure;
- a prompt's group keeps its validly scored samples; with fewer than
  ``loop.min_valid_samples_per_group`` of them it is dropped whole;
- advantages are computed over each remaining group's valid samples
  (``podrl.algorithms.advantages``), and a group with no reward variance is dropped;
- when more than ``loop.max_score_error_rate`` of the step's samples failed scoring, or all of
  them did, the attempt fails (``StepFailedError`` in phase ``score``) with the reward's own
  error message.

The ids of the Train requests are formatted and read here too. A step's attempt is
``<run name>:<process>:<step>:<attempt>`` (``<process>``: 8 hex digits drawn at controller start,
so a restarted controller never reuses an id a trainer may still hold as its last applied
batch). Each pod's request in round ``r`` of that attempt (a new round after a pod was lost
mid-Train, the batch re-split) is ``<attempt id>.<r>@<pod id>``. The run store keeps the attempt
id of the step in flight; a trainer reports the pod id it applied last, and a restart asks
whether that names the step in flight (:func:`names_step_batch`).
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from podrl.algorithms.advantages import batch_advantages
from podrl.controller.step_errors import StepFailedError
from podrl.tasks import PromptItem
from podrl.v1 import common_pb2, grader_pb2, trainer_pb2


def sample_id(prompt_id: str, index: int) -> str:
    """The id of one sample in ScoreItem, ItemScore and TrainSequence."""
    return f"{prompt_id}#{index}"


@dataclass
class StepSamples:
    """What the generate and score phases produced for one step attempt."""

    items: list[PromptItem]
    samples: dict[str, list[common_pb2.Sample]] = field(default_factory=dict)
    """Prompt id → its group of samples."""
    scores: dict[str, grader_pb2.ItemScore] = field(default_factory=dict)
    """Sample id → its score."""
    pod_of: dict[str, str] = field(default_factory=dict)
    """Prompt id → the pod whose generator sampled its group."""
    turns: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Sample id → a multi-turn episode's turns, as samples.jsonl shows them."""

    def prompts_by_pod(self) -> dict[str, int]:
        return dict(Counter(self.pod_of[item.id] for item in self.items if item.id in self.pod_of))

    def score_of(self, prompt_id: str, sample: common_pb2.Sample) -> grader_pb2.ItemScore:
        return self.scores[sample_id(prompt_id, sample.index)]

    def all_samples(self) -> list[tuple[PromptItem, common_pb2.Sample]]:
        return [(item, s) for item in self.items for s in self.samples[item.id]]


def is_valid(score: grader_pb2.ItemScore) -> bool:
    """The sample was scored: its reward is a real one, not the grader's fallback."""
    return score.error == grader_pb2.SCORE_ERROR_NONE


@dataclass(frozen=True)
class TrainBatch:
    """The sequences to train on and the step figures derived from the scores."""

    sequences: list[trainer_pb2.TrainSequence]
    stats: dict[str, Any]
    """Step-record figures: reward_mean / reward_max / reward_by_task over validly scored
    samples (None when there are none), score_errors (failed samples), score_errors_by_kind,
    dropped_samples (samples left out because of score errors: the failed ones and the valid
    ones of groups that fell below the minimum), groups, groups_dropped (for any reason),
    groups_dropped_score_errors, groups_equal_reward (groups whose valid rewards were all
    equal, dropped or trained at advantage 0), sequences_trained."""


def check_score_errors(data: StepSamples, max_error_rate: float) -> None:
    """Fail the attempt when too many samples failed scoring; the message carries the first
    failure's own error (the reward's exception, the timeout, ...)."""
    pairs = data.all_samples()
    failed = [(item, s) for item, s in pairs if not is_valid(data.score_of(item.id, s))]
    if not failed or (len(failed) < len(pairs) and len(failed) <= max_error_rate * len(pairs)):
        return
    item, sample = failed[0]
    first = data.score_of(item.id, sample)
    kinds = Counter(grader_pb2.ScoreError.Name(data.score_of(i.id, s).error) for i, s in failed)
    limit = (
        "every sample failed"
        if len(failed) == len(pairs)
        else f"above loop.max_score_error_rate = {max_error_rate:g}"
    )
    raise StepFailedError(
        "score",
        f"{len(failed)} of {len(pairs)} samples failed scoring ({limit}; "
        f"{', '.join(f'{k}: {n}' for k, n in sorted(kinds.items()))}); first, "
        f"{sample_id(item.id, sample.index)} (task {item.task!r}): "
        f"{grader_pb2.ScoreError.Name(first.error)}: {first.error_message}",
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def build_batch(
    data: StepSamples,
    *,
    normalize_std: bool,
    min_valid_per_group: int,
    keep_equal_reward_groups: bool = False,
) -> TrainBatch:
    """Advantages over the validly scored samples of each group, and the step's figures. A
    group whose rewards are all equal is dropped, or with ``keep_equal_reward_groups`` trained
    at advantage 0 (``loop.keep_equal_reward_groups``)."""
    valid: dict[str, list[common_pb2.Sample]] = {}
    too_few: set[str] = set()
    errors: Counter[str] = Counter()
    dropped_samples = 0
    for item in data.items:
        group = data.samples[item.id]
        kept = []
        for sample in group:
            score = data.score_of(item.id, sample)
            if is_valid(score):
                kept.append(sample)
            else:
                errors[grader_pb2.ScoreError.Name(score.error)] += 1
        if len(kept) < min_valid_per_group:
            too_few.add(item.id)
            dropped_samples += len(group)
        else:
            dropped_samples += len(group) - len(kept)
            valid[item.id] = kept
    advantages = batch_advantages(
        {pid: [data.score_of(pid, s).reward for s in group] for pid, group in valid.items()},
        normalize_std=normalize_std,
    )
    sequences = []
    for item in data.items:
        group = advantages.get(item.id)
        if group is None or (group.dropped and not keep_equal_reward_groups):
            continue
        # A valid group (at least two rewards) is dropped only for equal rewards.
        values = (0.0,) * len(valid[item.id]) if group.dropped else group.advantages
        for sample, advantage in zip(valid[item.id], values, strict=True):
            sequences.append(
                trainer_pb2.TrainSequence(
                    sample_id=sample_id(item.id, sample.index),
                    prompt_ids=sample.prompt_token_ids,
                    completion_ids=sample.token_ids,
                    generator_logprobs=sample.logprobs,
                    completion_mask=sample.completion_mask,
                    advantage=advantage,
                    policy_version=sample.policy_version,
                )
            )
    rewards: list[float] = []
    by_task: dict[str, list[float]] = {}
    for item, sample in data.all_samples():
        score = data.score_of(item.id, sample)
        if is_valid(score):
            rewards.append(score.reward)
            by_task.setdefault(item.task, []).append(score.reward)
    stats: dict[str, Any] = {
        "reward_mean": _mean(rewards),
        "reward_max": max(rewards) if rewards else None,
        "reward_by_task": {task: sum(v) / len(v) for task, v in by_task.items()},
        "score_errors": sum(errors.values()),
        "score_errors_by_kind": dict(errors),
        "dropped_samples": dropped_samples,
        "groups": len(data.items),
        "groups_dropped": len(too_few)
        + (0 if keep_equal_reward_groups else sum(g.dropped for g in advantages.values())),
        "groups_equal_reward": sum(g.dropped for g in advantages.values()),
        "groups_dropped_score_errors": len(too_few),
        "sequences_trained": len(sequences),
    }
    return TrainBatch(sequences, stats)


def _prompt_of(sequence: trainer_pb2.TrainSequence) -> str:
    return sequence.sample_id.rsplit("#", 1)[0]


def split_batch(
    sequences: list[trainer_pb2.TrainSequence], pods: list[str]
) -> dict[str, list[trainer_pb2.TrainSequence]]:
    """Each pod's share of the batch: whole groups (a prompt's samples stay together), balanced
    by tokens (each group goes to the pod with the fewest so far; ties to the earlier pod).
    A pod may get an empty share (fewer groups than pods). Pure and deterministic."""
    groups: dict[str, list[trainer_pb2.TrainSequence]] = {}
    for sequence in sequences:
        groups.setdefault(_prompt_of(sequence), []).append(sequence)
    shares: dict[str, list[trainer_pb2.TrainSequence]] = {pod: [] for pod in pods}
    tokens = dict.fromkeys(pods, 0)
    for group in groups.values():
        pod = min(pods, key=lambda p: (tokens[p], pods.index(p)))
        shares[pod].extend(group)
        tokens[pod] += sum(len(s.prompt_ids) + len(s.completion_ids) for s in group)
    return shares


def train_request(
    share: list[trainer_pb2.TrainSequence],
    batch: TrainBatch,
    policy_version: int,
    batch_id: str,
    pods: int = 1,
    pod_ids: Sequence[str] = (),
) -> trainer_pb2.TrainRequest:
    """One pod's Train call of a step: its ``share`` of ``batch`` with the batch-wide totals, so
    that the loss is normalised over the whole batch and the update of P pods equals the
    1-pod update, and the number of pods that train the step and their worker ids (the
    trainers check that their quorum holds exactly those pods). Re-sent unchanged when its
    outcome is unknown."""
    return trainer_pb2.TrainRequest(
        pods=pods,
        pod_ids=pod_ids,
        sequences=share,
        policy_version=policy_version,
        batch_id=batch_id,
        global_sequences=len(batch.sequences),
        # Trained tokens: an episode's mask leaves its environment replies out of the mean.
        global_completion_tokens=sum(
            sum(s.completion_mask) if s.completion_mask else len(s.completion_ids)
            for s in batch.sequences
        ),
    )


def group_version(data: StepSamples, prompt_id: str) -> int:
    """The policy version that sampled a prompt's group (one Generate call: one version; with
    in-flight weight updates the oldest of its versions, the one staleness is judged by). The
    episodes of a group are separate calls, each its own oldest version: the group's is the
    oldest of them (an episode that failed before its first turn sampled nothing)."""
    samples = data.samples[prompt_id]
    return min(
        (s.policy_version for s in samples if s.token_ids), default=samples[0].policy_version
    )


def last_version(sample: common_pb2.Sample) -> int:
    """The newest version that may have sampled a token of ``sample`` (its policy_version
    unless a weight update landed in flight while it ran; 0 from a generator without in-flight
    applies)."""
    return max(sample.policy_version, sample.last_policy_version)


@dataclass(frozen=True)
class StaleSplit:
    """A step's groups judged against the trainers' version (async mode)."""

    fresh: StepSamples
    """The groups sampled by versions >= current - max_staleness: the ones the batch is built
    from (same samples, scores and pods, only the stale prompts left out)."""
    staleness: dict[str, int]
    """Prompt id → current version minus the version that sampled its group (every group)."""
    stale: list[str]
    """Prompt ids of the groups dropped as too old, in draw order."""
    stale_samples: int
    """Samples of those groups."""
    spanning_samples: int = 0
    """Samples of the kept groups that more than one version sampled (a weight update landed
    in flight while they ran)."""

    def figures(self) -> dict[str, Any]:
        """Step-record figures: ``staleness_histogram`` (versions behind → groups kept),
        ``groups_dropped_stale``, ``samples_dropped_stale`` and
        ``samples_spanning_versions``."""
        dropped = set(self.stale)
        histogram = Counter(lag for pid, lag in self.staleness.items() if pid not in dropped)
        return {
            "staleness_histogram": {str(lag): n for lag, n in sorted(histogram.items())},
            "groups_dropped_stale": len(self.stale),
            "samples_dropped_stale": self.stale_samples,
            "samples_spanning_versions": self.spanning_samples,
        }


def split_stale(data: StepSamples, current_version: int, max_staleness: int) -> StaleSplit:
    """Leave out the groups sampled by a version older than ``current_version -
    max_staleness`` (pure; a group that several versions sampled is judged by the oldest). A
    group sampled by a version newer than the trainers' cannot come from this run's trainers:
    ``StepFailedError`` (the attempt is retried)."""
    staleness: dict[str, int] = {}
    for item in data.items:
        version = group_version(data, item.id)
        if version > current_version:
            raise StepFailedError(
                "generate",
                f"prompt {item.id}: sampled by policy version {version}, newer than the "
                f"trainers' {current_version}",
            )
        staleness[item.id] = current_version - version
    stale = [item.id for item in data.items if staleness[item.id] > max_staleness]
    dropped = set(stale)
    fresh = StepSamples(
        items=[item for item in data.items if item.id not in dropped],
        samples=data.samples,
        scores=data.scores,
        pod_of=data.pod_of,
    )
    spanning = sum(
        last_version(sample) > sample.policy_version
        for item in fresh.items
        for sample in data.samples[item.id]
    )
    return StaleSplit(
        fresh, staleness, stale, sum(len(data.samples[pid]) for pid in stale), spanning
    )


def with_stale_figures(batch: TrainBatch, split: StaleSplit) -> TrainBatch:
    """``batch`` (built from ``split.fresh``) with the stale groups counted in: ``groups`` and
    ``groups_dropped`` include them, plus :meth:`StaleSplit.figures`."""
    stats = dict(batch.stats)
    stats.update(split.figures())
    stats["groups"] = batch.stats["groups"] + len(split.stale)
    stats["groups_dropped"] = batch.stats["groups_dropped"] + len(split.stale)
    return TrainBatch(batch.sequences, stats)


# -- the batch ids of Train requests ----------------------------------------------------------
@dataclass(frozen=True)
class StepBatchId:
    """One attempt of one step."""

    process: str
    """``<run name>:<process>``, the same for every step of one controller process."""
    step: int
    attempt: int

    def __str__(self) -> str:
        return f"{self.process}:{self.step}:{self.attempt}"

    def for_pod(self, round_no: int, pod_id: str) -> str:
        """The batch id of ``pod_id``'s request in round ``round_no`` of this attempt."""
        return f"{self}.{round_no}@{pod_id}"


def process_prefix(run_name: str) -> str:
    """``<run name>:<process>`` for a controller process that starts now."""
    return f"{run_name}:{uuid.uuid4().hex[:8]}"


def attempt_of(batch_id: str) -> str | None:
    """The attempt id of a pod's batch id (``<attempt id>.<round>@<pod id>``); None when
    ``batch_id`` is not one."""
    head, at, pod_id = batch_id.rpartition("@")
    attempt_id, dot, round_no = head.rpartition(".")
    if not (at and pod_id and dot and attempt_id and round_no.isdigit()):
        return None
    return attempt_id


def names_step_batch(last_batch_id: str, step_batch_id: str) -> bool:
    """``last_batch_id`` (a trainer's) is one of the step's batches: the step's attempt id
    itself, or one pod's batch of any round of it."""
    if not step_batch_id or not last_batch_id:
        return False
    return last_batch_id == step_batch_id or attempt_of(last_batch_id) == step_batch_id
