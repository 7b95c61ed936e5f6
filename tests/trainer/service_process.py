"""Start the real trainer service (`python -m podrl.trainer`, its own rank launcher) for a test."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podrl.v1 import trainer_pb2_grpc
from tests.foundation.run_secret import authed_channel
from tests.trainer.rank_worker import config_env, free_port


@contextmanager
def trainer_service(
    model_dir: Path,
    tmp: Path,
    *,
    dp_shard: int = 2,
    timeout: float = 180,
    extra_env: dict[str, str] | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], trainer_pb2_grpc.TrainerStub]]:
    """The service with ``dp_shard`` FSDP2 ranks, SERVING; killed on exit if still running.
    ``extra_env`` reaches every rank (e.g. ``PODRL_FAULTS``, ``PODRL_TRAINER__*``)."""
    port = free_port()
    env = {
        **os.environ,
        **config_env(str(model_dir), str(tmp), dp_shard=dp_shard, micro_batch_size=2),
        "PODRL_TRAINER__GRPC_PORT": str(port),
        "PODRL_TRAINER__METRICS_PORT": "0",
        "PODRL_CONTROLLER__GRPC_PORT": str(free_port()),  # no controller: registration retries
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    log_path = tmp / "trainer.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "podrl.trainer"], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    channel = authed_channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="podrl.v1.Trainer")
        deadline = time.monotonic() + timeout
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if (
                    health.Check(request, timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    break
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"trainer did not start:\n{log_path.read_text()}"
            time.sleep(0.5)
        yield process, trainer_pb2_grpc.TrainerStub(channel)
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
            process.wait()
