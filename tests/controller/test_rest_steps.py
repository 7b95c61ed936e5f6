"""/v1/steps over real HTTP: pages past 1,000 steps, and bad input is a 422."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from podrl.cli.run_progress import fetch_all_steps
from podrl.controller.pods.table import PodTable
from podrl.controller.records.recorder import RunStore, StepRecord
from podrl.controller.service.status import RunState
from tests.controller.rest_server import served_rest_app

STEPS = 10_005


@pytest.fixture(scope="module")
def rest_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    store = RunStore(tmp_path_factory.mktemp("rest") / "controller.sqlite")
    for step in range(1, STEPS + 1):
        reward = None if step == 7 else step / STEPS  # step 7: recovered, reward unknown
        store.record_step(StepRecord(step, step, {}, {"reward_mean": reward}, float(step)))
    state = RunState("rest", PodTable(60), 1, STEPS)
    with served_rest_app(state, store) as url:
        yield url


def test_podrl_run_reads_every_step_page_by_page(rest_url: str) -> None:
    """The old `podrl run` read one default page: its reward curve stopped at step 1,000."""
    steps = fetch_all_steps(rest_url)
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    assert steps[6]["metrics"]["reward_mean"] is None  # unknown is null, not 0.0
    assert len(httpx.get(f"{rest_url}/v1/steps").json()) == 1000  # the default page


@pytest.mark.parametrize(
    "query", ["since=9223372036854775808", "since=-1", "limit=0", "limit=100001", "since=x"]
)
def test_out_of_range_queries_are_client_errors(rest_url: str, query: str) -> None:
    reply = httpx.get(f"{rest_url}/v1/steps?{query}")
    assert reply.status_code == 422, reply.text


def test_the_largest_since_is_an_empty_page(rest_url: str) -> None:
    reply = httpx.get(f"{rest_url}/v1/steps?since=9223372036854775807")
    assert reply.status_code == 200 and reply.json() == []
