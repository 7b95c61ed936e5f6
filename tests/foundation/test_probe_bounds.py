"""Hostile requests the services already bounded, kept bounded (they had no test of their own).

- a 300 MB message is RESOURCE_EXHAUSTED — refused by the server's own limit
  (``grpc.max_message_bytes``, 256 MiB by default) before any handler runs, and the service
  goes on serving. Shown on the grader (in-process, real gRPC socket) with the default limit.
- 10^5 prompts with n=1 in one Generate are bounded. The generator has no cap on the
  prompt count of its own: what bounds one request is its size in bytes (the same limit;
  RESOURCE_EXHAUSTED before the servicer), n (vLLM's cap, INVALID_ARGUMENT naming
  ``sampling.n``: tests/generator/test_hostile_requests.py) and each prompt's length
  (same file). Shown on the generator's real gRPC server and servicer while its engine
  is held back from loading (so no vLLM starts): a request of 10^5 prompts over the limit is
  refused by size; 10^5 small prompts under it reach the servicer, which answers them
  UNAVAILABLE while the engine loads.
- hostile Score requests are scored item by item and the grader serves on.
- The values no other test sends (top_p NaN or -0.5, top_k -5, stop [""]), with
  the others: the generator's request check refuses them naming the field (the error Generate
  answers INVALID_ARGUMENT, as tests/generator/test_generator_service.py shows through a real
  engine for some of them).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podrl.common.auth import AuthClientInterceptor
from podrl.common.processes import free_port
from podrl.common.service import ServiceProcess
from podrl.config import RunConfig
from podrl.config.transport import GrpcConfig
from podrl.generator.errors import InvalidRequestError
from podrl.generator.main import build_spec as build_generator_spec
from podrl.generator.servicer import sampling_from_proto
from podrl.v1 import common_pb2, generator_pb2, generator_pb2_grpc, grader_pb2, grader_pb2_grpc
from tests.foundation.run_secret import credentials
from tests.grader.conftest import RunningGrader, grader_config

MIB = 1024 * 1024


def _unlimited_channel(address: str) -> grpc.Channel:
    """A client that sends anything (the server's limit is under test, not the client's), with
    the run's credentials so that the call is not refused UNAUTHENTICATED first."""
    raw = grpc.insecure_channel(
        address,
        options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)],
    )
    return grpc.intercept_channel(raw, AuthClientInterceptor(credentials()))


def test_default_message_limit_is_256_mib() -> None:
    assert GrpcConfig().max_message_bytes == 256 * MIB  # what rows 7 and 8 rely on


# ---- row 8 ---------------------------------------------------------------------------------


@pytest.fixture
def grader() -> Iterator[RunningGrader]:
    tasks = [
        {
            "name": "reverse",
            "source": {"kind": "procedural", "generator": "reverse"},
            "rewards": [{"name": "exact_match"}],
        }
    ]
    running = RunningGrader(grader_config(tasks, workers=1))
    yield running
    running.stop()


def test_a_300_mb_message_is_resource_exhausted_and_the_grader_serves_on(
    grader: RunningGrader,
) -> None:
    assert grader.config.grpc.max_message_bytes == 256 * MIB  # the default limit
    huge = grader_pb2.ScoreRequest(
        items=[grader_pb2.ScoreItem(id="x", task="reverse", completion="a" * (300 * MIB))]
    )
    with _unlimited_channel(grader.address) as channel, pytest.raises(grpc.RpcError) as err:
        grader_pb2_grpc.GraderStub(channel).Score(huge, timeout=120)
    del huge
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    health = health_pb2_grpc.HealthStub(grader.channel).Check(
        health_pb2.HealthCheckRequest(service="podrl.v1.Grader"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    small = grader_pb2.ScoreRequest(
        items=[grader_pb2.ScoreItem(id="y", task="reverse", completion="ab", reference="ab")]
    )
    reply = grader_pb2_grpc.GraderStub(grader.channel).Score(small, timeout=30)
    assert [s.id for s in reply.scores] == ["y"] and reply.scores[0].reward == 1.0


# ---- row 7 ---------------------------------------------------------------------------------

PROMPTS = 100_000
LIMIT = 4 * MIB  # a smaller limit than the default, so that the test's requests stay small


class HeldGenerator:
    """The generator's real service (its gRPC server, options, interceptors and servicer) with
    the engine's load held back until the test ends: no vLLM starts."""

    def __init__(self, run_dir: Path) -> None:
        self.config = RunConfig.model_validate(
            {
                "worker_id": "probe-7",
                "run_dir": str(run_dir),
                "grpc": {"max_message_bytes": LIMIT},
                "controller": {"grpc_port": free_port()},  # nobody there: never registers
                "generator": {"grpc_port": free_port(), "metrics_port": 0},
            }
        )
        spec = build_generator_spec(self.config)
        self._release = threading.Event()

        def held_load() -> None:
            self._release.wait()
            raise RuntimeError("test over: the engine is never loaded")

        spec.until_ready = held_load
        self.process = ServiceProcess(spec, self.config)
        self._thread = threading.Thread(target=self._start, daemon=True)
        self._thread.start()
        self.address = f"127.0.0.1:{self.config.generator.grpc_port}"

    def _start(self) -> None:
        with contextlib.suppress(RuntimeError):  # the held load ended: start() shut it down
            self.process.start()

    def stop(self) -> None:
        self._release.set()
        self._thread.join(timeout=60)


@pytest.fixture
def held_generator(tmp_path: Path) -> Iterator[HeldGenerator]:
    generator = HeldGenerator(tmp_path)
    yield generator
    generator.stop()


def _generate(channel: grpc.Channel, request: generator_pb2.GenerateRequest) -> grpc.RpcError:
    stub = generator_pb2_grpc.GeneratorStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request, timeout=60, wait_for_ready=True)
    return err.value


def test_a_huge_generate_is_bounded_by_its_size_before_the_servicer(
    held_generator: HeldGenerator,
) -> None:
    sampling = common_pb2.SamplingParams(n=1, max_tokens=4, temperature=1.0)
    long_prompts = [common_pb2.Prompt(id=str(i), text="x" * 64) for i in range(PROMPTS)]
    over = generator_pb2.GenerateRequest(prompts=long_prompts, sampling=sampling)
    assert over.ByteSize() > LIMIT
    short_prompts = [common_pb2.Prompt(id=str(i), token_ids=[1]) for i in range(PROMPTS)]
    under = generator_pb2.GenerateRequest(prompts=short_prompts, sampling=sampling)
    assert under.ByteSize() < LIMIT
    with _unlimited_channel(held_generator.address) as channel:
        refused = _generate(channel, over)
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
        # Under the limit the request reaches the servicer: with no engine yet, UNAVAILABLE.
        reached = _generate(channel, under)
        assert reached.code() == grpc.StatusCode.UNAVAILABLE, reached.details()
        assert "still loading" in reached.details()


# ---- row 1 ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling", "field"),
    [
        ({"top_p": float("nan")}, "sampling.top_p"),
        ({"top_p": -0.5}, "sampling.top_p"),
        ({"top_p": 2.0}, "sampling.top_p"),
        ({"top_k": -5}, "sampling.top_k"),
        ({"stop": [""]}, "sampling.stop"),
        ({"temperature": -1.0}, "sampling.temperature"),
        ({"max_tokens": 0}, "sampling.max_tokens"),
    ],
)
def test_bad_sampling_values_are_refused_naming_the_field(
    sampling: dict[str, object], field: str
) -> None:
    params = common_pb2.SamplingParams(**{"max_tokens": 4, "temperature": 1.0, **sampling})
    with pytest.raises(InvalidRequestError, match=field.replace(".", r"\.")):
        sampling_from_proto(params)


# ---- rows 24-25 ----------------------------------------------------------------------------


def _scores(grader: RunningGrader, items: list[grader_pb2.ScoreItem]) -> grader_pb2.ScoreResponse:
    return grader_pb2_grpc.GraderStub(grader.channel).Score(
        grader_pb2.ScoreRequest(items=items), timeout=120
    )


def test_hostile_score_requests_are_scored_item_by_item(grader: RunningGrader) -> None:
    """Duplicate ids, control characters, 10,000 metadata keys, a 16 MB text and 2,000 items
    (the probe's 100 MB and 10^5 items take minutes here): each item gets its own score, in
    order, and the grader stays SERVING."""
    item = grader_pb2.ScoreItem
    control = "\x00\x07\x1b[2J"
    cases = {
        "duplicate ids": [item(id="a", task="reverse", completion="x", reference="x")] * 2,
        "control characters": [
            item(id=f"c{control}", task="reverse", completion=control, reference=control)
        ],
        "10,000 metadata keys": [
            item(
                id="m",
                task="reverse",
                completion="x",
                reference="x",
                metadata={f"k{i}": "v" for i in range(10_000)},
            )
        ],
        "a 16 MB text": [
            item(id="t", task="reverse", completion="a" * (16 * MIB), reference="a" * (16 * MIB))
        ],
        "2,000 items": [
            item(id=str(i), task="reverse", completion="ab", reference="ab") for i in range(2000)
        ],
    }
    for case, items in cases.items():
        reply = _scores(grader, items)
        assert [s.id for s in reply.scores] == [i.id for i in items], case
        assert all(s.error == grader_pb2.SCORE_ERROR_NONE and s.reward == 1.0 for s in reply.scores)
    health = health_pb2_grpc.HealthStub(grader.channel).Check(
        health_pb2.HealthCheckRequest(service="podrl.v1.Grader"), timeout=5
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING
