"""The live figures of a run's episodes and its latest episode: the one place that owns them.

The episode runner (``controller/rollout/episodes.py``) reports each episode's start, each turn
and each end here as they happen; the status (``/v1/status`` ``episodes``,
``/v1/episodes/latest``) reads the figures and the controller's Prometheus metrics are kept with
them. Built only when a task names an environment (``build_loop``), so a single-turn run's step
never runs this file.

The latest episode is shown as the environment and the model wrote it, and either may write
anything: megabytes, control characters that rewrite a terminal, markup. Its view cuts every text
so that the whole episode's texts stay within ``controller.episode_view_chars`` and writes each
control or format character as its escape (``\\x1b``), so the page and a terminal show it as
text; the dashboard then puts it in text nodes only.
"""

from __future__ import annotations

import threading
import unicodedata

from podrl.controller import loop_metrics
from podrl.controller.rollout.episodes import EpisodeOutcome, Turn
from podrl.controller.service.status import (
    EpisodeFiguresView,
    EpisodeTextView,
    EpisodeTurnView,
    LatestEpisodeView,
)

#: Characters kept as they are: line breaks and tabs lay the text out.
_LAYOUT = frozenset("\n\t")

#: The least a text of the latest episode keeps, however many turns share the budget.
MIN_TEXT_CHARS = 32


def _escaped(character: str) -> str:
    """A control, format (bidirectional overrides, zero-width marks) or surrogate character as
    its escape; every other character as it is."""
    if character in _LAYOUT or unicodedata.category(character) not in ("Cc", "Cf", "Cs"):
        return character
    return ascii(character)[1:-1]


def shown_text(text: str, limit: int) -> EpisodeTextView:
    """``text`` as the status shows it: at most ``limit`` characters, escapes included."""
    # An escape is never shorter than its character: the first ``limit`` characters are enough.
    shown = "".join(_escaped(c) for c in text[:limit])[:limit]
    return EpisodeTextView(text=shown, chars=len(text), truncated=len(text) > len(shown))


class EpisodeFigures:
    """Counts the episodes as the runner plays them and keeps the latest that ended.
    ``view_chars``: ``controller.episode_view_chars``, the latest episode's texts in all."""

    def __init__(self, view_chars: int) -> None:
        self.view_chars = view_chars
        self._lock = threading.Lock()
        self._in_flight = 0
        self._finished = 0
        self._failed = 0
        self._turns = 0
        self._tool_calls = 0
        self._tool_errors = 0
        self._seconds_total = 0.0
        self._seconds_max: float | None = None
        self._latest: EpisodeOutcome | None = None

    def started(self) -> None:
        """An episode begins (before its Reset)."""
        with self._lock:
            self._in_flight += 1
        loop_metrics.EPISODES_IN_FLIGHT.inc()

    def turn(self, turn: Turn) -> None:
        """An episode played a turn: its environment answered."""
        with self._lock:
            self._turns += 1
            self._tool_calls += turn.tool_calls
            self._tool_errors += turn.tool_errors
            self._seconds_total += turn.environment_seconds
            self._seconds_max = max(self._seconds_max or 0.0, turn.environment_seconds)
        loop_metrics.EPISODE_TURNS.inc()
        loop_metrics.EPISODE_TOOL_CALLS.inc(turn.tool_calls)
        loop_metrics.EPISODE_TOOL_ERRORS.inc(turn.tool_errors)
        loop_metrics.EPISODE_ENVIRONMENT_SECONDS.observe(turn.environment_seconds)

    def finished(self, outcome: EpisodeOutcome) -> None:
        """An episode is over: played to its end, failed by its environment, or cut off by a
        failed generator call (its rollout fails: no outcome, only no longer in flight)."""
        with self._lock:
            self._in_flight -= 1
            if outcome.error:
                self._failed += 1
            elif outcome.ended:
                self._finished += 1
            if outcome.error or outcome.ended:
                self._latest = outcome
        loop_metrics.EPISODES_IN_FLIGHT.dec()
        if outcome.error or outcome.ended:
            loop_metrics.EPISODES.labels("failed" if outcome.error else "ended").inc()

    def view(self) -> EpisodeFiguresView:
        with self._lock:
            return EpisodeFiguresView(
                in_flight=self._in_flight,
                finished=self._finished,
                failed=self._failed,
                turns=self._turns,
                tool_calls=self._tool_calls,
                tool_errors=self._tool_errors,
                environment_seconds_mean=self._seconds_total / self._turns if self._turns else None,
                environment_seconds_max=self._seconds_max,
            )

    def latest(self) -> LatestEpisodeView | None:
        """The latest episode that ended, its texts cut and escaped; built when asked for, so
        playing an episode costs no more than keeping a reference to it."""
        with self._lock:
            outcome = self._latest
        if outcome is None:
            return None
        # The budget is shared by every text (the prompt, each turn's action and observation,
        # the error): however many turns and whatever they hold, the view stays bounded.
        texts = 2 + 2 * len(outcome.turns)
        limit = max(MIN_TEXT_CHARS, self.view_chars // texts)
        episode = outcome.episode
        return LatestEpisodeView(
            episode_id=outcome.episode_id,
            prompt_id=outcome.prompt_id,
            prompt=shown_text(outcome.prompt, limit),
            prompt_tokens=0 if episode is None else len(episode.prompt_ids),
            turns=[
                EpisodeTurnView(
                    action=shown_text(turn.action, limit),
                    sampled_tokens=turn.sampled_tokens,
                    observation=shown_text(turn.observation, limit),
                    reply_tokens=turn.reply_tokens,
                    tool_calls=turn.tool_calls,
                    tool_errors=turn.tool_errors,
                    environment_seconds=turn.environment_seconds,
                )
                for turn in outcome.turns
            ],
            reward=None if outcome.error else outcome.reward,
            ended=outcome.ended,
            error=shown_text(outcome.error, limit) if outcome.error else None,
        )
