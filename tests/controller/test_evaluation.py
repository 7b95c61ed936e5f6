"""Held-out evaluation in the GRPO loop, against the fake pod (real gRPC) and the REAL grader of
tests/controller/fake_pod_loop.py: when it runs, that it samples greedily, trains nothing and
draws no training prompt, its figures, where they are recorded, and the export at the end."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from podrl.config import RunConfig
from podrl.controller.pods.table import PodTable
from podrl.controller.records.evaluation import greedy_sampling, score_evaluation
from podrl.controller.records.recorder import EVALS_KEY, RunStore
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RunState
from podrl.controller.step.batch import StepSamples, sample_id
from podrl.tasks import PromptItem
from podrl.v1 import common_pb2, generator_pb2, grader_pb2, trainer_pb2
from tests.controller.fake_pod_loop import ConfigFor, RunLoop, loop_config
from tests.controller.fake_workers import FakeGenerator, FakePod, FakeTrainer

EVAL_PROMPTS = 5


@pytest.fixture
def run_config() -> ConfigFor:
    """The fake-pod run config with a held-out part of the copy task (30 % of its prompts)."""

    def config(run_dir: Path, grader_port: int, **loop: Any) -> RunConfig:
        return loop_config(run_dir, grader_port, task={"split": {"eval": 0.3}}, **loop)

    return config


@pytest.fixture
def generate_requests(monkeypatch: pytest.MonkeyPatch) -> list[generator_pb2.GenerateRequest]:
    """Every GenerateRequest the fake generator receives, in order (ask for it before the pod:
    a servicer's methods are bound when its server registers them)."""
    seen: list[generator_pb2.GenerateRequest] = []
    original = FakeGenerator.Generate

    def recording(self, request, context):  # type: ignore[no-untyped-def]
        copy = generator_pb2.GenerateRequest()
        copy.CopyFrom(request)
        seen.append(copy)
        return original(self, request, context)

    monkeypatch.setattr(FakeGenerator, "Generate", recording)
    return seen


def _is_eval(prompt_id: str) -> bool:
    return "/eval/" in prompt_id


def _right_from_version(pod: FakePod, version: int) -> None:
    """Training samples as usual (half right); evaluation answers right only once the policy
    version is at least ``version`` (the generator serves the trainer's version)."""

    def complete(prompt: common_pb2.Prompt, index: int) -> str:
        if _is_eval(prompt.id):
            return prompt.reference if pod.generator.version >= version else "wrong"
        return prompt.reference if index % 2 == 0 else "wrong"

    pod.generator.complete = complete


def test_evaluations_before_every_k_and_at_the_end_train_nothing(
    generate_requests: list[generator_pb2.GenerateRequest], pod: FakePod, run_loop: RunLoop
) -> None:
    _right_from_version(pod, 2)
    run = run_loop(pod, steps=3, eval_prompts=EVAL_PROMPTS, eval_every=2)
    assert run["state"].phase == "finished", run["state"].error
    evaluations = run["summary"]["evaluations"]
    assert [(e["step"], e["policy_version"], e["when"]) for e in evaluations] == [
        (0, 0, "initial"),
        (2, 2, "periodic"),
        (3, 3, "final"),
    ]
    assert [e["accuracy"] for e in evaluations] == [0.0, 1.0, 1.0]
    assert [e["reward_mean"] for e in evaluations] == [0.0, 1.0, 1.0]
    assert evaluations[0]["by_task"]["copy"] == {
        "prompts": EVAL_PROMPTS,
        "scored": EVAL_PROMPTS,
        "passed": 0,
        "accuracy": 0.0,
        "reward_mean": 0.0,
    }
    assert run["summary"]["initial_eval"]["step"] == 0
    assert run["summary"]["final_eval"]["step"] == 3
    assert run["summary"]["eval_accuracy_gain"] == 1.0
    # Greedy, one completion each, the same prompts every time, never trained on.
    eval_requests = [r for r in generate_requests if _is_eval(r.prompts[0].id)]
    assert len(eval_requests) == 3
    for request in eval_requests:
        assert request.sampling.n == 1 and request.sampling.temperature == 0.0
        assert all(_is_eval(p.id) for p in request.prompts)
    asked = [[p.id for p in r.prompts] for r in eval_requests]
    assert asked[0] == asked[1] == asked[2] and len(asked[0]) == EVAL_PROMPTS
    trained = {s.sample_id for request in pod.trainer.applied for s in request.sequences}
    assert trained and not [s for s in trained if _is_eval(s)]
    assert not [row for row in run["samples"] if _is_eval(row["prompt_id"])]
    # The status page and /metrics have the latest.
    assert run["state"].view().last_eval["step"] == 3
    assert run["state"].view().evaluations == 3
    assert REGISTRY.get_sample_value("podrl_eval_accuracy") == 1.0
    assert REGISTRY.get_sample_value("podrl_eval_step") == 3
    assert REGISTRY.get_sample_value("podrl_eval_task_accuracy", {"task": "copy"}) == 1.0
    assert REGISTRY.get_sample_value("podrl_eval_reward_mean") == 1.0
    assert REGISTRY.get_sample_value("podrl_evaluations") == 3


def test_training_draws_the_same_prompts_with_evaluation_on_or_off(
    tmp_path: Path, run_loop: RunLoop, generate_requests: list[generator_pb2.GenerateRequest]
) -> None:
    trained: dict[str, list[list[str]]] = {}
    for label, loop in (("off", {}), ("on", {"eval_prompts": EVAL_PROMPTS, "eval_every": 1})):
        shutil.rmtree(tmp_path / "run", ignore_errors=True)  # a fresh run, not a resume
        pod = FakePod(tmp_path / "run" / "checkpoints")
        try:
            generate_requests.clear()
            run = run_loop(pod, steps=3, **loop)
        finally:
            pod.stop()
        assert run["state"].phase == "finished", run["state"].error
        training = [r for r in generate_requests if not _is_eval(r.prompts[0].id)]
        trained[label] = [[p.id + "|" + p.text for p in r.prompts] for r in training]
        if label == "on":
            assert len(run["summary"]["evaluations"]) == 4  # steps 0, 1, 2, 3
    assert trained["on"] == trained["off"]
    assert len(trained["on"]) == 3


def test_a_failing_evaluation_is_recorded_and_the_run_goes_on(
    tmp_path: Path, run_loop: RunLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    original = FakeGenerator.Generate

    def refuse_eval(self, request, context):  # type: ignore[no-untyped-def]
        if _is_eval(request.prompts[0].id):
            context.abort(grpc.StatusCode.INTERNAL, "injected: the evaluation breaks")
        return original(self, request, context)

    monkeypatch.setattr(FakeGenerator, "Generate", refuse_eval)  # before the pod registers it
    pod = FakePod(tmp_path / "run" / "checkpoints")
    try:
        run = run_loop(pod, steps=2, eval_prompts=EVAL_PROMPTS)
    finally:
        pod.stop()
    assert run["state"].phase == "finished", run["state"].error
    assert run["summary"]["steps_trained"] == 2
    evaluations = run["summary"]["evaluations"]
    assert [e["step"] for e in evaluations] == [0, 2]
    for evaluation in evaluations:
        assert evaluation["accuracy"] is None and evaluation["reward_mean"] is None
        assert "the evaluation breaks" in evaluation["error"]
    assert run["summary"]["initial_eval"] is None
    assert run["summary"]["eval_accuracy_gain"] is None


def test_the_run_exports_the_trained_policy_and_the_summary_names_it(
    tmp_path: Path, run_loop: RunLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    exported: list[str] = []

    def export(self, request, context):  # type: ignore[no-untyped-def]
        exported.append(request.path)
        return trainer_pb2.ExportHFResponse(
            path=request.path, files=["config.json", "model.safetensors"]
        )

    monkeypatch.setattr(FakeTrainer, "ExportHF", export)  # before the pod registers it
    pod = FakePod(tmp_path / "run" / "checkpoints")
    try:
        run = run_loop(pod, steps=2)
    finally:
        pod.stop()
    assert run["state"].phase == "finished", run["state"].error
    [path] = exported
    assert Path(path).name == "export"
    assert run["summary"]["export"] == {
        "path": path,
        "files": ["config.json", "model.safetensors"],
        "step": 2,
        "policy_version": 2,
        "error": None,
    }


def test_a_failed_export_is_recorded_and_the_run_still_finishes(
    pod: FakePod, run_loop: RunLoop
) -> None:
    run = run_loop(pod, steps=1)  # the fake trainer does not implement ExportHF
    assert run["state"].phase == "finished", run["state"].error
    assert run["summary"]["export"]["path"] is None
    assert "UNIMPLEMENTED" in run["summary"]["export"]["error"]


def test_export_at_end_off_asks_for_no_export(pod: FakePod, run_loop: RunLoop) -> None:
    run = run_loop(pod, steps=1, export_at_end=False)
    assert run["state"].phase == "finished", run["state"].error
    assert run["summary"]["export"] is None


def _scored(
    rewards: dict[str, tuple[str, float | None]],
) -> StepSamples:
    """One-sample groups with the given (task, reward); None = the scoring failed."""
    items = [PromptItem(pid, task, "q", "a", "a\n") for pid, (task, _) in rewards.items()]
    data = StepSamples(items=items)
    for item in items:
        data.samples[item.id] = [common_pb2.Sample(prompt_id=item.id, index=0, text="x")]
        reward = rewards[item.id][1]
        data.scores[sample_id(item.id, 0)] = (
            grader_pb2.ItemScore(reward=reward)
            if reward is not None
            else grader_pb2.ItemScore(reward=0.0, error=grader_pb2.SCORE_ERROR_EXCEPTION)
        )
    return data


def test_accuracy_counts_rewards_at_or_above_the_tasks_pass_threshold() -> None:
    data = _scored(
        {
            "a/1": ("add", 1.0),
            "a/2": ("add", 0.5),
            "a/3": ("add", None),  # failed scoring: in neither figure
            "c/1": ("copy", 0.5),
            "c/2": ("copy", 0.4),
        }
    )
    figures = score_evaluation(data, {"add": 1.0, "copy": 0.5})
    assert figures["by_task"]["add"] == {
        "prompts": 3,
        "scored": 2,
        "passed": 1,
        "accuracy": 0.5,
        "reward_mean": 0.75,
    }
    assert figures["by_task"]["copy"]["passed"] == 1  # 0.5 >= its threshold 0.5; 0.4 is not
    assert figures["score_errors"] == 1
    assert figures["accuracy"] == pytest.approx(2 / 4)
    assert figures["reward_mean"] == pytest.approx((1.0 + 0.5 + 0.5 + 0.4) / 4)


def test_greedy_sampling_keeps_the_loops_length_and_stop_but_not_its_temperature() -> None:
    config = RunConfig.model_validate(
        {"loop": {"sampling": {"n": 8, "temperature": 1.0, "max_tokens": 6, "stop": ["\n"]}}}
    )
    greedy = greedy_sampling(config.loop.sampling)
    assert (greedy.n, greedy.temperature, greedy.top_p, greedy.top_k) == (1, 0.0, 1.0, 0)
    assert (greedy.max_tokens, greedy.stop) == (6, ["\n"])
    assert config.loop.sampling.temperature == 1.0  # the loop's own sampling is unchanged


def test_v1_evals_serves_the_recorded_evaluations(tmp_path: Path) -> None:
    store = RunStore(tmp_path / "controller.sqlite")
    record = {
        "step": 0,
        "policy_version": 0,
        "when": "initial",
        "prompts": 4,
        "accuracy": 0.25,
        "reward_mean": 0.5,
        "by_task": {"copy": {"accuracy": 0.25}},
        "seconds": 0.1,
        "finished_at": 1.0,
        "error": None,
    }
    store.put(EVALS_KEY, [record, {**record, "step": 5, "when": "final", "accuracy": 0.75}])
    state = RunState("evals", PodTable(60), 1)
    client = TestClient(build_rest_app(state, store))
    body = client.get("/v1/evals").json()
    assert [(e["step"], e["accuracy"]) for e in body] == [(0, 0.25), (5, 0.75)]
    assert body[0]["by_task"] == {"copy": {"accuracy": 0.25}}
    store.close()


@pytest.mark.parametrize(
    ("loop", "tasks_split", "message"),
    [
        ({"eval_prompts": 8}, None, "no task in tasks.definitions has evaluation prompts"),
        ({"eval_every": 5}, {"eval": 0.1}, "loop.eval_prompts is 0"),
    ],
)
def test_evaluation_knobs_without_what_they_need_are_refused(
    loop: dict[str, int], tasks_split: dict[str, float] | None, message: str
) -> None:
    task: dict[str, Any] = {
        "name": "copy",
        "source": {"kind": "procedural", "generator": "copy"},
        "rewards": [{"name": "exact_match"}],
    }
    if tasks_split:
        task["split"] = tasks_split
    with pytest.raises(ValueError, match=message):
        RunConfig.model_validate({"loop": loop, "tasks": {"definitions": [task]}})


def _turn(tool_calls: int, tool_errors: int = 0) -> dict[str, object]:
    return {"action": "x", "observation": "", "tool_calls": tool_calls, "tool_errors": tool_errors}


def test_an_evaluation_of_episodes_says_how_accuracy_splits_by_tool_calls() -> None:
    data = _scored(
        {
            "p/1": ("calc", 1.0),  # called the tool, right
            "p/2": ("calc", 0.0),  # called it twice (one failed), wrong
            "p/3": ("calc", 0.0),  # answered without a call, wrong
            "p/4": ("calc", None),  # the environment failed: in no figure
            "c/1": ("copy", 1.0),  # single-turn: no turns, no tool figures
        }
    )
    data.turns = {
        "p/1#0": [_turn(1), _turn(0)],
        "p/2#0": [_turn(1, 1), _turn(1), _turn(0)],
        "p/3#0": [_turn(0)],
        "p/4#0": [_turn(1)],
    }
    figures = score_evaluation(data, {"calc": 1.0, "copy": 1.0})
    expected = {
        "episodes": 3,
        "tool_call_rate": pytest.approx(2 / 3),
        "accuracy_with_tool": 0.5,
        "accuracy_without_tool": 0.0,
        "tool_calls": 3,
        "tool_errors": 1,
    }
    assert figures["tool_use"] == expected
    assert figures["by_task"]["calc"]["tool_use"] == expected
    assert "tool_use" not in figures["by_task"]["copy"]
    assert figures["accuracy"] == pytest.approx(2 / 4)
    # Without episodes an evaluation has no tool figures at all.
    assert "tool_use" not in score_evaluation(_scored({"c/1": ("copy", 1.0)}), {"copy": 1.0})
