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
import dataclasses
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from podrl.config.environments import EnvironmentsConfig
from podrl.config.loop import SamplingConfig
from podrl.config.tasks import TaskConfig
from podrl.controller.pods.table import Pod, PodTable
from podrl.controller.step.batch import StepSamples, sample_id
from podrl.controller.step.pod_calls import (
    WorkerClients,
    WorkerPhases,
    prompt_seed,
    settle,
    split_round_robin,
)
from podrl.controller.step_errors import StepFailedError, describe_rpc_error
from podrl.environments.episode import Episode, EpisodeError
from podrl.tasks import PromptItem
from podrl.v1 import (
    common_pb2,
    environment_pb2,
    environment_pb2_grpc,
    generator_pb2,
    generator_pb2_grpc,
    grader_pb2,
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
    policy_version: int = 0
    """The version served when the turn's Generate began: every token of the turn is recorded
    with it (the oldest that may have sampled any of them)."""
    last_policy_version: int = 0
    """The version served when the turn's request finished: above ``policy_version`` when a
    weight update landed in flight during the turn (its later tokens came from newer weights;
    which ones the generator does not say)."""


@dataclass
class EpisodeOutcome:
    """One finished episode: trainable (``error`` empty) or failed."""

    episode_id: str
    prompt_id: str
    index: int
    episode: Episode | None = None
    prompt: str = ""
    """The first turn's prompt text: the task's prompt and Reset's observation."""
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


class EpisodeWatcher(Protocol):
    """Follows the episodes as they play: the run's live figures
    (``controller/rollout/episode_figures.py``)."""

    def started(self) -> None: ...
    def turn(self, turn: Turn) -> None: ...
    def finished(self, outcome: EpisodeOutcome) -> None: ...


class EpisodeRunner:
    """Plays the episodes of a step over one generator and one environment service."""

    def __init__(
        self,
        generator: generator_pb2_grpc.GeneratorStub,
        environment: environment_pb2_grpc.EnvironmentStub,
        settings: EpisodeSettings,
        watcher: EpisodeWatcher | None = None,
    ) -> None:
        self.generator = generator
        self.environment = environment
        self.settings = settings
        self.watcher = watcher

    def run(
        self,
        items: Sequence[PromptItem],
        n: int,
        step: int,
        seeds: Mapping[str, int | None] | None = None,
    ) -> dict[str, list[EpisodeOutcome]]:
        """``n`` episodes of every item, concurrently; prompt id → its outcomes by index.
        ``seeds``: prompt id → its seed (episode ``i`` and its turns derive theirs from it).
        Raises :class:`GenerateFailedError` when the generator fails."""
        jobs = [(item, index) for item in items for index in range(n)]
        workers = max(1, min(self.settings.episodes_in_flight, len(jobs)))
        seeds = seeds or {}
        with ThreadPoolExecutor(workers, thread_name_prefix="episode") as pool:
            futures = [
                pool.submit(self.play, item, index, f"{step}:{item.id}#{index}", seeds.get(item.id))
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
        if self.watcher is not None:
            self.watcher.started()
        try:
            self._play(item, outcome, seed)
        except _EnvironmentFailedError as err:
            outcome.error = str(err)
        except EpisodeError as err:  # the prompt or a turn does not fit the episode's tokens
            outcome.error = f"episode: {err}"
        finally:
            # A session the service dropped (failed, idle) is gone already.
            with contextlib.suppress(grpc.RpcError):
                self.environment.Close(
                    environment_pb2.CloseRequest(episode_id=episode_id),
                    timeout=self.settings.timeout_seconds,
                )
            if self.watcher is not None:
                self.watcher.finished(outcome)
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
        outcome.prompt = item.prompt + reset.observation
        episode: Episode | None = None
        for _ in range(s.max_turns):
            if episode is None:  # the first turn: the prompt as text, its ids come back
                prompt = common_pb2.Prompt(id=item.id, text=outcome.prompt)
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
                policy_version=sample.policy_version,
                last_policy_version=max(sample.policy_version, sample.last_policy_version),
            )
            outcome.turns.append(turn)
            if self.watcher is not None:
                self.watcher.turn(turn)
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

    def _environment(self, method: str, request: object) -> Any:
        """``method``'s reply; a failed call fails the episode (``_EnvironmentFailedError``)."""
        try:
            return getattr(self.environment, method)(request, timeout=self.settings.timeout_seconds)
        except grpc.RpcError as err:
            raise _EnvironmentFailedError(
                f"environment {method}: {describe_rpc_error(err)}"
            ) from err


class _EnvironmentFailedError(Exception):
    """An environment call failed: the episode is an error (caught in ``play``)."""


def environment_address(generator_address: str, port: int) -> str:
    """Where a pod's environment service listens: it runs in the worker pod beside the
    generator (its own container, docs/environments.md), so on the generator's host at
    ``environments.grpc_port``."""
    host = generator_address.rsplit(":", 1)[0]
    return f"{host}:{port}"


def episode_sample(outcome: EpisodeOutcome) -> common_pb2.Sample:
    """An episode as the step's samples carry it: its completion is every token after the
    prompt, its mask says which were sampled; empty when it failed before its first turn."""
    episode = outcome.episode
    sample = common_pb2.Sample(prompt_id=outcome.prompt_id, index=outcome.index)
    if episode is None or not episode.turns:
        return sample
    versions = [v for span in episode.spans for v in span.versions]
    sample.prompt_token_ids.extend(episode.prompt_ids)
    sample.token_ids.extend(episode.completion_ids)
    sample.logprobs.extend(episode.generator_logprobs)
    sample.completion_mask.extend(episode.loss_mask)
    sample.text = "".join(turn.action + turn.observation for turn in outcome.turns)
    sample.finish_reason = common_pb2.FINISH_REASON_STOP
    sample.policy_version = episode.oldest_version
    # The newest version that may have sampled a token: a turn that an in-flight update
    # landed in reached its last_policy_version, which no token is recorded with.
    sample.last_policy_version = max(
        max(versions), max(turn.last_policy_version for turn in outcome.turns)
    )
    return sample


def episode_score(outcome: EpisodeOutcome, sample_id: str) -> grader_pb2.ItemScore:
    """The environment's reward as the step's score, or the environment's failure as a
    scoring error (left out of training, counted by ``loop.max_score_error_rate``)."""
    if outcome.error:
        return grader_pb2.ItemScore(
            id=sample_id,
            error=grader_pb2.SCORE_ERROR_ENVIRONMENT,
            error_message=outcome.error,
            latency_seconds=outcome.environment_seconds,
        )
    return grader_pb2.ItemScore(
        id=sample_id,
        reward=outcome.reward,
        components={"environment": outcome.reward},
        latency_seconds=outcome.environment_seconds,
    )


def turn_rows(outcome: EpisodeOutcome) -> list[dict[str, Any]]:
    """An episode's turns as samples.jsonl shows them."""
    return [dataclasses.asdict(turn) for turn in outcome.turns]


class EpisodePhases(WorkerPhases):
    """Generate and Score of a run whose tasks name environments: the items of those tasks are
    played as episodes on the step's pods (each pod's generator and environment service), the
    others are generated and scored as before. Built only when a task names an environment, so
    a single-turn run's step never runs this file."""

    def __init__(
        self,
        clients: WorkerClients,
        pool: ThreadPoolExecutor,
        table: PodTable,
        tasks: Sequence[TaskConfig],
        environments: EnvironmentsConfig,
        watcher: EpisodeWatcher | None = None,
    ) -> None:
        super().__init__(clients, pool, table)
        self.tasks = {task.name: task for task in tasks if task.environment is not None}
        self.environments = environments
        self.watcher = watcher

    def generate(
        self,
        step: int,
        data: StepSamples,
        sampling: SamplingConfig,
        policy_version: int | None,
        pods: list[Pod],
    ) -> None:
        plain = [item for item in data.items if item.task not in self.tasks]
        episodic = [item for item in data.items if item.task in self.tasks]
        if plain:
            part = StepSamples(items=plain)
            super().generate(step, part, sampling, policy_version, pods)
            data.samples.update(part.samples)
            data.pod_of.update(part.pod_of)
        if episodic:
            self._play(step, data, episodic, sampling, policy_version, pods)

    def _play(
        self,
        step: int,
        data: StepSamples,
        items: list[PromptItem],
        sampling: SamplingConfig,
        policy_version: int | None,
        pods: list[Pod],
    ) -> None:
        pods = self._check_pods(pods)
        if not pods:
            raise StepFailedError("generate", "no healthy pod can play episodes (none admitted)")
        seeds = {
            item.id: None if sampling.seed is None else prompt_seed(sampling.seed, step, item.id)
            for item in items
        }
        by_task: dict[str, list[PromptItem]] = {}
        for item in items:
            by_task.setdefault(item.task, []).append(item)
        jobs = [
            (pod, task, chunk)
            for task, task_items in by_task.items()
            for pod, chunk in zip(pods, split_round_robin(task_items, len(pods)), strict=False)
        ]

        def play(pod: Pod, task: str, chunk: list[PromptItem]) -> None:
            runner = self._runner(pod, self.tasks[task], sampling)
            try:
                outcomes = runner.run(chunk, sampling.n, step, seeds)
            except GenerateFailedError as err:
                # As a failed Generate: the attempt fails and the step is retried.
                raise StepFailedError("generate", f"pod {pod.id}: {err}") from err
            for item in chunk:
                data.pod_of[item.id] = pod.id
                data.samples[item.id] = [episode_sample(o) for o in outcomes[item.id]]
                for outcome in outcomes[item.id]:
                    sid = sample_id(item.id, outcome.index)
                    data.scores[sid] = episode_score(outcome, sid)
                    data.turns[sid] = turn_rows(outcome)

        for outcome in settle(self.pool, [lambda j=j: play(*j) for j in jobs]):
            if isinstance(outcome, BaseException):
                raise outcome
        self.table.note_shares(prompts=data.prompts_by_pod())
        if policy_version is None:
            return
        for item in items:
            stale = [
                s.policy_version
                for s in data.samples[item.id]
                if s.token_ids and s.policy_version != policy_version
            ]
            if stale:
                raise StepFailedError(
                    "generate",
                    f"prompt {item.id}: an episode sampled by policy version {stale[0]}, "
                    f"expected {policy_version}",
                )

    def _runner(self, pod: Pod, task: TaskConfig, sampling: SamplingConfig) -> EpisodeRunner:
        config = self.environments
        return EpisodeRunner(
            self.clients.generator(pod.generator),
            self.clients.environment(environment_address(pod.generator, config.grpc_port)),
            EpisodeSettings(
                environment=task.environment or "",
                sampling=common_pb2.SamplingParams(
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    top_k=sampling.top_k,
                    max_tokens=sampling.max_tokens,
                    stop=sampling.stop,
                ),
                turn_stop=task.turn_stop,
                max_episode_tokens=config.max_episode_tokens,
                max_turns=config.max_turns,
                episodes_in_flight=config.episodes_in_flight,
                timeout_seconds=self.clients.long,
            ),
            self.watcher,
        )

    def score(self, data: StepSamples, pods: list[Pod]) -> None:
        """Episodes were scored by their environment while they played; the other items go to
        the graders as before."""
        plain = [item for item in data.items if item.task not in self.tasks]
        if not plain:
            return
        part = StepSamples(
            items=plain,
            samples={item.id: data.samples[item.id] for item in plain},
            pod_of={item.id: data.pod_of[item.id] for item in plain if item.id in data.pod_of},
        )
        super().score(part, pods)
        data.scores.update(part.scores)
