"""The token-exact episode: the sequence, loss mask, behaviour logprobs and versions of an episode
built turn by turn, checked token by token, and the turns it refuses."""

from __future__ import annotations

import pytest

from podrl.environments.episode import Episode, EpisodeError


def two_turn_episode() -> Episode:
    episode = Episode(prompt_ids=(1, 2, 3), max_tokens=16)
    episode.add_sampled([10, 11], [-0.5, -0.25], [4, 4])  # "<calc>..</calc>"
    episode.add_reply([20, 21, 22])  # "<result>..</result>", rendered by the runner
    episode.add_sampled([12], [-1.0], [5])  # the answer, after an in-flight update
    return episode


def test_the_sequence_mask_logprobs_and_versions_token_by_token() -> None:
    episode = two_turn_episode()
    assert episode.token_ids == (1, 2, 3, 10, 11, 20, 21, 22, 12)
    assert episode.completion_ids == (10, 11, 20, 21, 22, 12)
    assert episode.loss_mask == (1, 1, 0, 0, 0, 1)
    assert episode.generator_logprobs == (-0.5, -0.25, 0.0, 0.0, 0.0, -1.0)
    assert (episode.turns, episode.trained_tokens) == (2, 3)
    assert episode.oldest_version == 4  # staleness counts from the oldest sampled token
    assert episode.remaining_tokens == 16 - 9


def test_every_trained_token_is_a_sampled_one() -> None:
    episode = two_turn_episode()
    trained = [t for t, m in zip(episode.completion_ids, episode.loss_mask, strict=True) if m]
    sampled = [t for span in episode.spans if span.sampled for t in span.ids]
    assert trained == sampled == [10, 11, 12]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda e: e.add_reply([5]), "must follow a sampled turn"),
        (lambda e: (e.add_sampled([1], [-1.0], [0]), e.add_sampled([2], [-1.0], [0])), "follow"),
        (lambda e: e.add_sampled([1, 2], [-1.0], [0, 0]), "one logprob and one policy version"),
        (lambda e: e.add_sampled([1], [0.5], [0]), "finite and <= 0"),
        (lambda e: e.add_sampled([1], [float("nan")], [0]), "finite and <= 0"),
        (lambda e: e.add_sampled([], [], []), "one token at least"),
        (
            lambda e: (
                e.add_sampled([1], [-1.0], [3]),
                e.add_reply([9]),
                e.add_sampled([2], [-1.0], [2]),
            ),
            "never decreases",
        ),
        (lambda e: (e.add_sampled([1], [-1.0], [0]), e.add_reply([])), "empty reply"),
    ],
)
def test_turns_out_of_order_or_malformed_are_refused(build: object, message: str) -> None:
    episode = Episode(prompt_ids=(1,), max_tokens=16)
    with pytest.raises(EpisodeError, match=message):
        build(episode)  # type: ignore[operator]


def test_the_token_limit_names_its_field() -> None:
    episode = Episode(prompt_ids=(1, 2, 3, 4), max_tokens=8)
    episode.add_sampled([5, 6], [-1.0, -1.0], [0, 0])
    with pytest.raises(EpisodeError) as err:
        episode.add_reply([7, 8, 9])  # 4 + 2 + 3 = 9 > 8
    assert "environments.max_episode_tokens (8; 6 used)" in str(err.value)
    episode.add_reply([7, 8])  # exactly at the limit
    assert episode.remaining_tokens == 0
    with pytest.raises(EpisodeError, match=r"environments\.max_episode_tokens"):
        Episode(prompt_ids=tuple(range(9)), max_tokens=8)
    with pytest.raises(EpisodeError, match="prompt_ids: empty"):
        Episode(prompt_ids=(), max_tokens=8)


def test_an_episode_without_a_turn_has_no_version() -> None:
    with pytest.raises(EpisodeError, match="no sampled token"):
        _ = Episode(prompt_ids=(1,), max_tokens=4).oldest_version
