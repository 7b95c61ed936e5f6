"""The Score RPC over a real gRPC socket: batching, per-item failures, and that the grader keeps
serving through reward functions that raise, hang or kill their worker process."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from podrl.v1 import common_pb2, grader_pb2, grader_pb2_grpc
from tests.grader.conftest import RunningGrader, grader_config

PLUGIN = "tests.grader.faulty_rewards:behaves_by_completion"
ITEM_TIMEOUT = 1.0
WORKERS = 2


def _tasks() -> list[dict]:
    return [
        {
            "name": "flaky",
            "source": {"kind": "procedural", "generator": "add"},
            "rewards": [{"name": "flaky_plugin"}],
            "fallback_reward": -1.0,
        },
        {
            "name": "reverse",
            "source": {"kind": "procedural", "generator": "reverse"},
            "rewards": [
                {"name": "exact_match", "weight": 0.5},
                {"name": "char_match", "weight": 0.5},
            ],
        },
    ]


@pytest.fixture
def grader(start_grader: Callable) -> RunningGrader:
    config = grader_config(
        _tasks(),
        workers=WORKERS,
        item_timeout_seconds=ITEM_TIMEOUT,
        reward_plugins={"flaky_plugin": PLUGIN},
    )
    return start_grader(config)


def _score(grader: RunningGrader, items: list[tuple[str, str, str, str]], timeout: float = 30):
    stub = grader_pb2_grpc.GraderStub(grader.channel)
    request = grader_pb2.ScoreRequest(
        items=[
            grader_pb2.ScoreItem(id=i, task=task, completion=completion, reference=reference)
            for i, task, completion, reference in items
        ]
    )
    return stub.Score(request, timeout=timeout)


def _health(grader: RunningGrader) -> int:
    stub = health_pb2_grpc.HealthStub(grader.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service="podrl.v1.Grader"), timeout=5).status


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_faulty_plugins_fail_alone_and_the_grader_keeps_serving(grader: RunningGrader) -> None:
    timeouts_before = _metric("podrl_grader_timeouts_total", task="flaky")
    died_before = _metric("podrl_grader_errors_total", task="flaky", error="worker_died")
    items = [
        ("good-1", "flaky", "3", "3"),
        ("raise", "flaky", "RAISE", "3"),
        ("hang", "flaky", "HANG", "3"),
        ("exit", "flaky", "EXIT", "3"),
        ("good-2", "flaky", "4", "3"),
        ("rev", "reverse", "cba", "cba"),
        ("rev-half", "reverse", "cbx", "cba"),
    ]
    start = time.monotonic()
    reply = _score(grader, items)
    elapsed = time.monotonic() - start
    # One hung item holds one worker for the timeout; the rest run on the other worker.
    assert elapsed < ITEM_TIMEOUT * 2 + 3, elapsed
    by_id = {score.id: score for score in reply.scores}
    assert [score.id for score in reply.scores] == [item[0] for item in items]

    assert by_id["good-1"].error == grader_pb2.SCORE_ERROR_NONE
    assert by_id["good-1"].reward == 1.0
    assert by_id["good-1"].components["flaky_plugin"] == 1.0
    assert by_id["good-2"].error == grader_pb2.SCORE_ERROR_NONE
    assert by_id["good-2"].reward == 0.0
    assert by_id["rev"].reward == pytest.approx(1.0)
    assert by_id["rev-half"].reward == pytest.approx(0.5 * 0 + 0.5 * 2 / 3)
    assert dict(by_id["rev-half"].components) == pytest.approx(
        {"exact_match": 0.0, "char_match": 2 / 3}
    )

    assert by_id["raise"].error == grader_pb2.SCORE_ERROR_EXCEPTION
    assert "this reward function is broken" in by_id["raise"].error_message
    assert by_id["hang"].error == grader_pb2.SCORE_ERROR_TIMEOUT
    assert by_id["exit"].error == grader_pb2.SCORE_ERROR_WORKER_DIED
    assert "exit code 7" in by_id["exit"].error_message
    for failed in ("raise", "hang", "exit"):
        assert by_id[failed].reward == -1.0  # the task's fallback reward
        assert not by_id[failed].components

    assert _health(grader) == health_pb2.HealthCheckResponse.SERVING
    assert _metric("podrl_grader_timeouts_total", task="flaky") == timeouts_before + 1
    assert (
        _metric("podrl_grader_errors_total", task="flaky", error="worker_died") == died_before + 1
    )

    # The next batch is scored normally, by replaced workers.
    start = time.monotonic()
    again = _score(grader, [(f"n{i}", "flaky", str(i), "5") for i in range(10)])
    assert time.monotonic() - start < 5
    assert [s.error for s in again.scores] == [grader_pb2.SCORE_ERROR_NONE] * 10
    assert [s.reward for s in again.scores] == [1.0 if i == 5 else 0.0 for i in range(10)]
    assert _health(grader) == health_pb2.HealthCheckResponse.SERVING


def test_unknown_task_is_a_per_item_error(grader: RunningGrader) -> None:
    reply = _score(grader, [("a", "nope", "1", "1"), ("b", "flaky", "1", "1")])
    assert reply.scores[0].error == grader_pb2.SCORE_ERROR_UNKNOWN_TASK
    assert "'nope'" in reply.scores[0].error_message
    assert reply.scores[0].reward == 0.0  # grader.fallback_reward
    assert reply.scores[1].error == grader_pb2.SCORE_ERROR_NONE
    assert reply.scores[1].reward == 1.0


def test_empty_id_is_invalid_argument(grader: RunningGrader) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _score(grader, [("a", "flaky", "1", "1"), ("", "flaky", "1", "1")])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "items[1].id" in err.value.details()


def test_empty_batch_gives_empty_reply(grader: RunningGrader) -> None:
    assert list(_score(grader, []).scores) == []


def test_info_lists_tasks_and_reward_functions(grader: RunningGrader) -> None:
    info = grader_pb2_grpc.GraderStub(grader.channel).Info(common_pb2.InfoRequest(), timeout=5)
    assert list(info.tasks) == ["flaky", "reverse"]
    assert {"exact_match", "math_verify", "reasoning_gym", "flaky_plugin"} <= set(
        info.reward_functions
    )
    reverse = next(t for t in info.task_rewards if t.task == "reverse")
    assert list(reverse.components) == ["exact_match", "char_match"]
    assert list(reverse.weights) == [0.5, 0.5]
    flaky = next(t for t in info.task_rewards if t.task == "flaky")
    assert list(flaky.sources) == [PLUGIN]
    assert flaky.fallback_reward == -1.0
    assert info.workers == WORKERS
    assert info.item_timeout_seconds == ITEM_TIMEOUT


def _grandchildren() -> set[int]:
    # Workers are forked by the fork server, a child of this process: they are grandchildren.
    me = psutil.Process()
    return {p.pid for p in me.children(recursive=True) if p.ppid() != me.pid}


def test_shutdown_stops_the_worker_processes(start_grader: Callable) -> None:
    before = _grandchildren()
    config = grader_config(_tasks(), reward_plugins={"flaky_plugin": PLUGIN})
    grader = start_grader(config)
    _score(grader, [("a", "flaky", "1", "1")])
    workers = [psutil.Process(pid) for pid in _grandchildren() - before]
    assert len(workers) == config.grader.workers
    grader.stop()
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


def test_built_in_rewards_are_scored_without_worker_processes(start_grader: Callable) -> None:
    """A grader whose tasks use only cheap built-ins starts no worker process and scores in
    its own thread, with the pool's results (the weighted sum and the components)."""
    before = _grandchildren()
    grader = start_grader(grader_config([_tasks()[1]]))
    reply = _score(grader, [("same", "reverse", "cba", "cba"), ("half", "reverse", "cbx", "cba")])
    by_id = {s.id: s for s in reply.scores}
    assert by_id["same"].error == grader_pb2.SCORE_ERROR_NONE
    assert by_id["same"].reward == pytest.approx(1.0)
    assert by_id["half"].reward == pytest.approx(0.5 * 0.0 + 0.5 * 2 / 3)
    assert dict(by_id["half"].components) == pytest.approx(
        {"exact_match": 0.0, "char_match": 2 / 3}
    )
    assert _grandchildren() - before == set()  # no worker process was started
    assert _health(grader) == health_pb2.HealthCheckResponse.SERVING


def test_a_built_in_that_raises_in_the_grader_thread_fails_its_item_alone() -> None:
    """score_inline turns a reward's exception into SCORE_ERROR_EXCEPTION with the message the
    pool gives and the task's fallback reward; which plans score inline."""
    from podrl.grader.rewards import RewardComponent, TaskRewardPlan
    from podrl.grader.rewards.scoring import BUILTIN_REWARDS, ItemInput
    from podrl.grader.servicer import score_inline, scores_inline

    def plan(name: str, **params: object) -> TaskRewardPlan:
        component = RewardComponent(name, BUILTIN_REWARDS[name], 1.0, params, (), name)
        return TaskRewardPlan("t", (component,), fallback_reward=-1.0)

    # max_chars <= free_chars (the config refuses it; built by hand here): ValueError.
    broken = plan("length_penalty", max_chars=1, free_chars=1)
    result = score_inline(broken, ItemInput("p", "xx", "1", "t"))
    assert result.error == grader_pb2.SCORE_ERROR_EXCEPTION
    assert result.error_message.startswith("ValueError: max_chars (1) must exceed")
    assert result.reward == -1.0
    assert not result.components
    assert scores_inline(plan("exact_match")) and scores_inline(plan("char_match"))
    for pooled in ("regex_match", "math_verify", "reasoning_gym"):
        assert not scores_inline(plan(pooled))
