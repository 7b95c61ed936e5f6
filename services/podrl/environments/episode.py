"""A token-exact episode: one token sequence built once, turn by turn, never re-tokenized.

The sequence is the prompt's tokens, then per turn the tokens the generator sampled (trained:
each with its behaviour logprob and the policy version that sampled it) and, unless the episode
ended, the tokens of the environment's reply (not trained: loss mask 0). Replies arrive as
token ids, rendered once by whoever holds the tokenizer; this type takes ids only, so the
tokens trained are exactly the tokens generated, and the next turn is generated over
:attr:`Episode.token_ids`, the same prefix.

The episode runner (podrl.controller.rollout.episodes) builds it; the trainer trains its
``TrainSequence`` with the loss mask (docs/environments.md, "The episode runner").
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field


class EpisodeError(ValueError):
    """A turn that would make the episode wrong (out of order, mismatched lengths, over the
    token limit); the message names what and, for a limit, the config field."""


@dataclass(frozen=True)
class Span:
    """Consecutive tokens of one kind: a turn's sampled tokens or an environment's reply."""

    ids: tuple[int, ...]
    sampled: bool
    logprobs: tuple[float, ...] = ()
    """Behaviour logprobs of sampled tokens (empty for a reply)."""
    versions: tuple[int, ...] = ()
    """Policy version that sampled each token (empty for a reply)."""


@dataclass
class Episode:
    """Built with :meth:`add_sampled` and :meth:`add_reply` in turn, starting with a sampled
    turn; ``max_tokens`` is ``environments.max_episode_tokens``."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    spans: list[Span] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prompt_ids = tuple(self.prompt_ids)
        if not self.prompt_ids:
            raise EpisodeError("prompt_ids: empty (the first sampled token needs context)")
        self._check_room(len(self.prompt_ids), "the prompt", used=0)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The whole sequence: the prefix the next turn is generated over."""
        return self.prompt_ids + self.completion_ids

    @property
    def completion_ids(self) -> tuple[int, ...]:
        """Every token after the prompt, sampled and replied, in order."""
        return tuple(token for span in self.spans for token in span.ids)

    @property
    def loss_mask(self) -> tuple[int, ...]:
        """Per completion token: 1 sampled (trained), 0 the environment's reply."""
        return tuple(int(span.sampled) for span in self.spans for _ in span.ids)

    @property
    def generator_logprobs(self) -> tuple[float, ...]:
        """Per completion token: the behaviour logprob of a sampled token, 0.0 on a reply
        (masked: the trainer never reads it)."""
        return tuple(
            value
            for span in self.spans
            for value in (span.logprobs if span.sampled else (0.0,) * len(span.ids))
        )

    @property
    def turns(self) -> int:
        return sum(span.sampled for span in self.spans)

    @property
    def trained_tokens(self) -> int:
        return sum(len(span.ids) for span in self.spans if span.sampled)

    @property
    def oldest_version(self) -> int:
        """The policy version of the episode's oldest sampled token: its staleness is bounded
        by this one (an episode may span versions)."""
        if not self.turns:
            raise EpisodeError("the episode has no sampled token yet")
        return min(version for span in self.spans for version in span.versions)

    @property
    def remaining_tokens(self) -> int:
        """How many tokens the episode may still grow by (the next turn's budget at most)."""
        return self.max_tokens - len(self.prompt_ids) - len(self.completion_ids)

    def add_sampled(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]
    ) -> None:
        """A turn's tokens as the generator sampled them: one logprob and one policy version
        per token (an in-flight weight update may change the version inside a turn)."""
        if self.spans and self.spans[-1].sampled:
            raise EpisodeError("a turn must follow the prompt or an environment reply")
        if not ids:
            raise EpisodeError("ids: a turn samples one token at least")
        if not len(ids) == len(logprobs) == len(versions):
            raise EpisodeError(
                f"{len(ids)} ids, {len(logprobs)} logprobs and {len(versions)} versions: send "
                "one logprob and one policy version per sampled token"
            )
        if not all(math.isfinite(value) and value <= 0 for value in logprobs):
            raise EpisodeError("logprobs: every sampled token's logprob is finite and <= 0")
        earlier = [v for span in self.spans for v in span.versions]
        ordered = [*earlier[-1:], *versions]
        if any(later < sooner for sooner, later in itertools.pairwise(ordered)):
            raise EpisodeError(
                f"versions: {list(versions)} after {earlier[-1:]} go back; a policy version "
                "never decreases within an episode"
            )
        self._check_room(len(ids), "this turn")
        self.spans.append(Span(tuple(ids), True, tuple(logprobs), tuple(versions)))

    def add_reply(self, ids: Sequence[int]) -> None:
        """The environment's reply, already rendered to token ids (not trained)."""
        if not self.spans or not self.spans[-1].sampled:
            raise EpisodeError("an environment reply must follow a sampled turn")
        if not ids:
            raise EpisodeError("ids: an empty reply adds nothing; leave it out")
        self._check_room(len(ids), "this reply")
        self.spans.append(Span(tuple(ids), False))

    def _check_room(self, tokens: int, what: str, used: int | None = None) -> None:
        used = self.max_tokens - self.remaining_tokens if used is None else used
        if used + tokens > self.max_tokens:
            raise EpisodeError(
                f"{what} ({tokens} tokens) does not fit environments.max_episode_tokens "
                f"({self.max_tokens}; {used} used): end the episode, or raise the limit "
                "(at most generator.max_model_len)"
            )
