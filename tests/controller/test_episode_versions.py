"""Policy versions of an episode whose turns span weight updates (docs/environments.md, "Policy
versions within an episode"), with hand values: each turn records the version its Generate
began with on every token and the version its request finished with; the episode's sample
carries the oldest token's version (staleness) and the newest that may have sampled any token;
a group of episodes is as old as its oldest episode."""

from __future__ import annotations

from podrl.controller.rollout.episodes import (
    EpisodeOutcome,
    EpisodeRunner,
    episode_sample,
)
from podrl.controller.step.batch import StepSamples, group_version, split_stale
from podrl.tasks import PromptItem
from podrl.v1 import common_pb2
from tests.controller.episode_stand_ins import (
    StandInEnvironment,
    StandInGenerator,
    stand_in_settings,
)


def _play(versions: list[tuple[int, int]]) -> EpisodeOutcome:
    settings = stand_in_settings()
    runner = EpisodeRunner(StandInGenerator(versions), StandInEnvironment(), settings)  # type: ignore[arg-type]
    item = PromptItem(id="p", task="calc", prompt="Add:", reference="", target="")
    return runner.play(item, 0, "1:p#0")


def test_each_turn_records_the_versions_it_began_and_finished_with() -> None:
    """Turn 2's Generate began at version 3 and an update to 4 landed in flight; turn 3 began
    at 4. Every token of a turn is recorded with the version its Generate began with (the
    generator reports no version per token)."""
    outcome = _play([(3, 3), (3, 4), (4, 4)])
    assert [(t.policy_version, t.last_policy_version) for t in outcome.turns] == [
        (3, 3),
        (3, 4),
        (4, 4),
    ]
    assert outcome.episode is not None
    assert [span.versions for span in outcome.episode.spans if span.sampled] == [
        (3, 3),
        (3, 3),
        (4, 4),
    ]
    assert outcome.episode.oldest_version == 3


def test_the_episode_sample_spans_from_the_oldest_token_to_the_newest_version() -> None:
    """An update landed during the last turn: no token is recorded with version 5, yet the
    sample's last_policy_version is 5 (without the turn's own record it was 4, and the episode
    was not counted among the samples that spanned versions)."""
    sample = episode_sample(_play([(4, 4), (4, 4), (4, 5)]))
    assert (sample.policy_version, sample.last_policy_version) == (4, 5)
    # A generator without in-flight applies answers last_policy_version 0: read as the first.
    sample = episode_sample(_play([(2, 0), (2, 0), (3, 0)]))
    assert (sample.policy_version, sample.last_policy_version) == (2, 3)


def _group(*versions: int) -> StepSamples:
    samples = [
        common_pb2.Sample(index=i, token_ids=[1] if v else [], policy_version=v)
        for i, v in enumerate(versions)
    ]
    item = PromptItem(id="g", task="calc", prompt="", reference="", target="")
    return StepSamples(items=[item], samples={"g": samples})


def test_a_group_of_episodes_is_as_old_as_its_oldest_episode() -> None:
    """The episodes of one prompt are separate Generate calls: the second began a version
    before the first. The group counts as sampled by 4, so at trainer version 6 with
    loop.max_staleness 1 it is dropped (judged by its first episode, 5, it was kept). An
    episode that failed before its first turn (no tokens, version 0) does not count."""
    data = _group(5, 4, 0)
    assert group_version(data, "g") == 4
    split = split_stale(data, current_version=6, max_staleness=1)
    assert split.staleness == {"g": 2} and split.stale == ["g"]
    assert group_version(_group(7, 7), "g") == 7  # one Generate call: one version
