"""Multi-turn episodes (docs/environments.md, "The episode runner"): for each prompt x sample,
``Reset`` the environment, then per turn ``Generate`` over the episode's whole prefix as token
ids, ``Step`` with the sampled text and append the reply's tokens, until the environment ends
the episode or a limit does; the reward is the environment's at the end.

Who tokenizes: the generator (``Generator.Tokenize``), once per reply. The prompt is sent as
text on the first turn and its ids come back in the sample (tokenized as a single-turn prompt
is); from then on every turn is generated over ``Episode.token_ids``, so no token is ever
re-tokenized from text and the trained tokens are exactly the sampled ones. The controller
holds no tokenizer: it imports neither torch nor vLLM nor the model's files, and the ids come
from the very tokenizer that generates.

Many episodes run at once, each in a thread of its own over the blocking gRPC stubs: every
turn is a separate Generate call, so the generator's engine batches the turns of all episodes
in flight (and its prefix cache holds each episode's prefix). A failed environment call (its
code raised, timed out, ran out of memory, its worker died) makes that episode an error: kept
with its message, never trained; a failed generator call fails the whole rollout
(:class:`GenerateFailedError`), as a failed Generate fails a single-turn step.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from podrl.controller.step_errors import describe_rpc_error
from podrl.environments.episode import Episode, EpisodeError
from podrl.tasks import PromptItem
from podrl.v1 import (
    common_pb2,
    environment_pb2,
    environment_pb2_grpc,
    generator_pb2,
    generator_pb2_grpc,
    trainer_pb2,
)


class GenerateFailedError(RuntimeError):
    """A Generate or Tokenize call of an episode failed: the generator, not the environment."""


@dataclass(frozen=True)
class Turn:
    """One turn of an episode as samples.jsonl and the status show it."""

    action: str
    """The text the model sampled (the tool call's closing tag included)."""
    observation: str
    """The environment's reply ("" on the turn that ended the episode)."""
    sampled_tokens: int
    reply_tokens: int
    tool_calls: int
    tool_errors: int
    environment_seconds: float


@dataclass
class EpisodeOutcome:
    """One finished episode: trainable (``error`` empty) or failed."""

    episode_id: str
    prompt_id: str
    index: int
    episode: Episode | None = None
    reward: float = 0.0
    error: str = ""
    """Why the environment failed the episode; such an episode is never trained."""
    ended: str = ""
    """``done`` (the environment ended it), ``truncated`` (``environments.max_turns``), or
    ``tokens`` (``environments.max_episode_tokens`` left no room for the next turn)."""
    turns: list[Turn] = field(default_factory=list)

    @property
    def tool_calls(self) -> int:
        return sum(turn.tool_calls for turn in self.turns)

    @property
    def tool_errors(self) -> int:
        return sum(turn.tool_errors for turn in self.turns)

    @property
    def environment_seconds(self) -> float:
        return sum(turn.environment_seconds for turn in self.turns)

    def train_sequence(self, sample_id: str, advantage: float) -> trainer_pb2.TrainSequence:
        """The episode as the trainer takes it: its replies masked, its staleness the oldest
        sampled token's policy version."""
        if self.episode is None or self.error:
            raise ValueError(f"episode {self.episode_id} failed ({self.error}): never trained")
        episode = self.episode
        return trainer_pb2.TrainSequence(
            sample_id=sample_id,
            prompt_ids=episode.prompt_ids,
            completion_ids=episode.completion_ids,
            generator_logprobs=episode.generator_logprobs,
            completion_mask=episode.loss_mask,
            advantage=advantage,
            policy_version=episode.oldest_version,
        )


@dataclass(frozen=True)
class EpisodeSettings:
    """What one rollout of episodes runs with."""

    environment: str
    sampling: common_pb2.SamplingParams
    """Per turn: ``n`` is ignored (one sample per episode), ``max_tokens`` caps each turn."""
    turn_stop: Sequence[str]
    """Strings that end a turn and stay in its text (a tool call's closing tag)."""
    max_episode_tokens: int
    max_turns: int
    episodes_in_flight: int = 64
    timeout_seconds: float = 600.0
    """Deadline of each Generate, Tokenize and environment call."""


class EpisodeRunner:
    """Plays the episodes of a step over one generator and one environment service."""

    def __init__(
        self,
        generator: generator_pb2_grpc.GeneratorStub,
        environment: environment_pb2_grpc.EnvironmentStub,
        settings: EpisodeSettings,
        on_turn: Callable[[Turn], None] | None = None,
    ) -> None:
        self.generator = generator
        self.environment = environment
        self.settings = settings
        self.on_turn = on_turn
        self._lock = threading.Lock()
        self.in_flight = 0
        """Episodes running now (the status reads it)."""

    def run(
        self, items: Sequence[PromptItem], n: int, step: int, seed: int | None = None
    ) -> dict[str, list[EpisodeOutcome]]:
        """``n`` episodes of every item, concurrently; prompt id → its outcomes by index.
        Raises :class:`GenerateFailedError` when the generator fails."""
        jobs = [(item, index) for item in items for index in range(n)]
        workers = max(1, min(self.settings.episodes_in_flight, len(jobs)))
        with ThreadPoolExecutor(workers, thread_name_prefix="episode") as pool:
            futures = [
                pool.submit(self.play, item, index, f"{step}:{item.id}#{index}", seed)
                for item, index in jobs
            ]
            outcomes = [future.result() for future in futures]
        grouped: dict[str, list[EpisodeOutcome]] = {item.id: [] for item in items}
        for outcome in outcomes:
            grouped[outcome.prompt_id].append(outcome)
        return grouped

    def play(
        self, item: PromptItem, index: int, episode_id: str, seed: int | None = None
    ) -> EpisodeOutcome:
        """One episode, start to end; the environment's session is closed whatever happens."""
        outcome = EpisodeOutcome(episode_id=episode_id, prompt_id=item.id, index=index)
        with self._lock:
            self.in_flight += 1
        try:
            self._play(item, outcome, seed)
        except _EnvironmentFailedError as err:
            outcome.error = str(err)
        except EpisodeError as err:  # the prompt or a turn does not fit the episode's tokens
            outcome.error = f"episode: {err}"

        finally:
            with self._lock:
                self.in_flight -= 1
            # A session the service dropped (failed, idle) is gone already.
            with contextlib.suppress(grpc.RpcError):
                self.environment.Close(
                    environment_pb2.CloseRequest(episode_id=episode_id),
                    timeout=self.settings.timeout_seconds,
                )
        return outcome

    def _play(self, item: PromptItem, outcome: EpisodeOutcome, seed: int | None) -> None:
        s = self.settings
        started = time.monotonic()
        reset = self._environment(
            "Reset",
            environment_pb2.ResetRequest(
                episode_id=outcome.episode_id,
                environment=s.environment,
                prompt=item.prompt,
                reference=item.reference,
                metadata=item.metadata,
                seed=(seed or 0) + outcome.index,
            ),
        )
        reset_seconds = time.monotonic() - started
        episode: Episode | None = None
        for _ in range(s.max_turns):
            if episode is None:  # the first turn: the prompt as text, its ids come back
                prompt = common_pb2.Prompt(id=item.id, text=item.prompt + reset.observation)
                budget = s.sampling.max_tokens
            else:
                prompt = common_pb2.Prompt(id=item.id, token_ids=episode.token_ids)
                budget = min(s.sampling.max_tokens, episode.remaining_tokens)
            sample = self._generate(prompt, budget, seed, outcome)
            if episode is None:
                episode = Episode(sample.prompt_token_ids, max_tokens=s.max_episode_tokens)
                outcome.episode = episode
            # Every token of the turn is recorded with the version its first token had: the
            # oldest that may have sampled it, which is what staleness is judged by.
            episode.add_sampled(
                sample.token_ids, sample.logprobs, [sample.policy_version] * len(sample.token_ids)
            )
            started = time.monotonic()
            reply = self._environment(
                "Step",
                environment_pb2.StepRequest(episode_id=outcome.episode_id, action=sample.text),
            )
            seconds = time.monotonic() - started + reset_seconds
            reset_seconds = 0.0
            outcome.reward = reply.reward
            reply_ids: list[int] = []
            if not reply.done and reply.observation:
                reply_ids = self._tokenize(reply.observation)
            turn = Turn(
                action=sample.text,
                observation=reply.observation,
                sampled_tokens=len(sample.token_ids),
                reply_tokens=len(reply_ids),
                tool_calls=reply.tool_calls,
                tool_errors=reply.tool_errors,
                environment_seconds=seconds,
            )
            outcome.turns.append(turn)
            if self.on_turn is not None:
                self.on_turn(turn)
            if reply.done:
                outcome.ended = "truncated" if reply.truncated else "done"
                return
            # The next turn needs the reply and at least one token of room.
            if len(reply_ids) + 1 > episode.remaining_tokens:
                outcome.ended = "tokens"
                return
            if reply_ids:
                episode.add_reply(reply_ids)
        outcome.ended = "truncated"

    def _generate(
        self, prompt: common_pb2.Prompt, budget: int, seed: int | None, outcome: EpisodeOutcome
    ) -> common_pb2.Sample:
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.settings.sampling)
        sampling.n = 1
        sampling.max_tokens = budget
        sampling.stop.extend(self.settings.turn_stop)
        sampling.include_stop_str_in_output = True
        if seed is not None:  # each episode and turn its own stream, the same on a rerun
            prompt.seed = (seed + 1_000_003 * outcome.index + 7919 * len(outcome.turns)) % 2**62
        try:
            reply = self.generator.Generate(
                generator_pb2.GenerateRequest(
                    prompts=[prompt], sampling=sampling, request_id=outcome.episode_id
                ),
                timeout=self.settings.timeout_seconds,
            )
        except grpc.RpcError as err:
            raise GenerateFailedError(
                f"episode {outcome.episode_id}: Generate: {describe_rpc_error(err)}"
            ) from err
        return reply.samples[0]

    def _tokenize(self, text: str) -> list[int]:
        try:
            reply = self.generator.Tokenize(
                generator_pb2.TokenizeRequest(texts=[text]), timeout=self.settings.timeout_seconds
            )
        except grpc.RpcError as err:
            raise GenerateFailedError(f"Tokenize: {describe_rpc_error(err)}") from err
        return list(reply.tokens[0].ids)

    def _environment(self, method: str, request: object) -> object:
        try:
            return getattr(self.environment, method)(request, timeout=self.settings.timeout_seconds)
        except grpc.RpcError as err:
            raise _EnvironmentFailedError(
                f"environment {method}: {describe_rpc_error(err)}"
            ) from err


class _EnvironmentFailedError(Exception):
    """An environment call failed: the episode is an error (caught in ``play``)."""
