"""The run's authentication on every RPC (podrl.common.auth), over real gRPC: in-process
ServiceProcesses with the real interceptor, clients made by the real channel factory.

Probe rows of 2026-12-01 covered here: 18 and 31 (no credentials: UNAUTHENTICATED, nothing
registered), 36 (a caller that is not the controller gets no work and may not train or apply).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podrl.common.auth import CallerCredentials, RunSecret, load_run_secret
from podrl.common.grpc_options import open_channel
from podrl.common.processes import free_ports
from podrl.common.service import ServiceProcess, ServiceSpec
from podrl.config import ConfigError, RunConfig
from podrl.config.auth import AuthConfig
from podrl.config.transport import GrpcConfig
from podrl.controller.pods.table import PodTable
from podrl.controller.service.servicer import ControllerServicer
from podrl.controller.service.status import RunState
from podrl.v1 import (
    common_pb2,
    controller_pb2,
    controller_pb2_grpc,
    generator_pb2,
    generator_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)
from tests.foundation.run_secret import credentials

POD = "pod-0"


def _config(**sections: object) -> RunConfig:
    grpc_port, http_port, other = free_ports(3)
    return RunConfig.model_validate(
        {
            "worker_id": "controller-0",
            "controller": {"grpc_port": grpc_port, "http_port": http_port},
            "trainer": {"grpc_port": other, "metrics_port": 0},
            **sections,
        }
    )


class Stack:
    """One gRPC server (a ServiceProcess) that hosts the Controller servicer, and the Trainer
    and Generator base servicers (every method UNIMPLEMENTED: a call that passed the auth
    checks reaches them and says so)."""

    def __init__(self, config: RunConfig) -> None:
        self.registry = PodTable(heartbeat_timeout_seconds=60)
        self.state = RunState("auth-test", self.registry, min_worker_pods=1)
        servicer = ControllerServicer(self.state, heartbeat_interval_seconds=1)

        def add(server: grpc.Server) -> None:
            controller_pb2_grpc.add_ControllerServicer_to_server(servicer, server)
            trainer_pb2_grpc.add_TrainerServicer_to_server(
                trainer_pb2_grpc.TrainerServicer(), server
            )
            generator_pb2_grpc.add_GeneratorServicer_to_server(
                generator_pb2_grpc.GeneratorServicer(), server
            )

        spec = ServiceSpec(
            name="controller",
            grpc_service="podrl.v1.Controller",
            section=config.controller,
            add_servicers=add,
        )
        self.process = ServiceProcess(spec, config)
        self.process.start()
        self.address = config.controller.address

    def channel(self, creds: CallerCredentials | None) -> grpc.Channel:
        return open_channel(self.address, GrpcConfig(), creds)


@pytest.fixture
def stack() -> Iterator[Stack]:
    running = Stack(_config())
    yield running
    running.process.shutdown("test finished")


def _register(worker_id: str = POD, component: int = controller_pb2.COMPONENT_TRAINER):
    return controller_pb2.RegisterRequest(
        worker_id=worker_id, component=component, address="127.0.0.1:50053", incarnation="i-1"
    )


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


WRONG_SECRET = RunSecret(secrets.token_hex(32).encode(), "another run")


@pytest.mark.parametrize(
    "creds",
    [None, CallerCredentials(WRONG_SECRET, "trainer", POD)],
    ids=["no credentials", "another run's secret"],
)
def test_a_caller_without_the_run_secret_changes_nothing(
    stack: Stack, creds: CallerCredentials | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Before these checks, a fake trainer registered as a healthy pod (and then got
    the run's batches), and any process could call Train or ApplyWeights."""
    channel = stack.channel(creds)
    controller = controller_pb2_grpc.ControllerStub(channel)
    trainer = trainer_pb2_grpc.TrainerStub(channel)
    generator = generator_pb2_grpc.GeneratorStub(channel)
    calls = {
        "Register": lambda: controller.Register(_register(), timeout=5),
        "Heartbeat": lambda: controller.Heartbeat(
            controller_pb2.HeartbeatRequest(worker_id=POD, component=3, incarnation="i-1"),
            timeout=5,
        ),
        "Drain": lambda: controller.Drain(
            controller_pb2.DrainRequest(worker_id=POD, component=3, incarnation="i-1"), timeout=5
        ),
        "GetStatus": lambda: controller.GetStatus(controller_pb2.GetStatusRequest(), timeout=5),
        "Train": lambda: trainer.Train(trainer_pb2.TrainRequest(batch_id="x"), timeout=5),
        "ApplyWeights": lambda: generator.ApplyWeights(
            generator_pb2.ApplyWeightsRequest(rollback=True), timeout=5
        ),
        "Info": lambda: trainer.Info(common_pb2.InfoRequest(), timeout=5),
    }
    with caplog.at_level(logging.WARNING, logger="podrl.common.auth"):
        codes = {name: _code(call) for name, call in calls.items()}
    assert codes == dict.fromkeys(calls, grpc.StatusCode.UNAUTHENTICATED)
    assert stack.registry.members() == []
    refusals = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == len(calls)
    assert all("from ipv4:127.0.0.1:" in line for line in refusals)  # the refused peer
    channel.close()


def test_a_refused_request_is_not_parsed_and_is_counted(stack: Stack) -> None:
    """Bytes that are no RegisterRequest at all: without credentials the answer is still
    UNAUTHENTICATED (never a parse error), and the refusal is in the server's RPC counter."""
    from prometheus_client import REGISTRY

    labels = {
        "grpc_service": "podrl.v1.Controller",
        "grpc_method": "Register",
        "grpc_code": "UNAUTHENTICATED",
    }
    before = REGISTRY.get_sample_value("podrl_grpc_server_handled_total", labels) or 0
    with stack.channel(None) as channel:
        raw = channel.unary_unary("/podrl.v1.Controller/Register")  # no serializers: bytes
        assert _code(lambda: raw(b"\xff\xff\xff not protobuf", timeout=5)) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
    after = REGISTRY.get_sample_value("podrl_grpc_server_handled_total", labels)
    assert after == before + 1


def test_a_claim_given_twice_is_refused(stack: Stack) -> None:
    """Two podrl-mac entries (one of them valid) are refused: the server never has to choose."""
    valid = credentials("trainer", POD).metadata()
    with stack.channel(None) as channel:
        stub = controller_pb2_grpc.ControllerStub(channel)
        doubled = (*valid, ("podrl-mac", "0" * 64))
        call = lambda: stub.Register(_register(), metadata=doubled, timeout=5)  # noqa: E731
        assert _code(call) == grpc.StatusCode.UNAUTHENTICATED
        ok = lambda: stub.Register(_register(), metadata=valid, timeout=5)  # noqa: E731
        assert _code(ok) == grpc.StatusCode.OK  # the same claim once is accepted


def test_health_and_reflection_need_no_credentials(stack: Stack) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with stack.channel(None) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="podrl.v1.Controller"), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        listing = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in listing for s in r.list_services_response.service}
    assert "podrl.v1.Controller" in names


CONTROLLER_ONLY_CALLS = {
    "Train": lambda ch: trainer_pb2_grpc.TrainerStub(ch).Train(
        trainer_pb2.TrainRequest(), timeout=5
    ),
    "PublishWeights": lambda ch: trainer_pb2_grpc.TrainerStub(ch).PublishWeights(
        trainer_pb2.PublishWeightsRequest(), timeout=5
    ),
    "AcknowledgeWeights": lambda ch: trainer_pb2_grpc.TrainerStub(ch).AcknowledgeWeights(
        trainer_pb2.AcknowledgeWeightsRequest(), timeout=5
    ),
    "SaveCheckpoint": lambda ch: trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(
        trainer_pb2.SaveCheckpointRequest(), timeout=5
    ),
    "LoadCheckpoint": lambda ch: trainer_pb2_grpc.TrainerStub(ch).LoadCheckpoint(
        trainer_pb2.LoadCheckpointRequest(), timeout=5
    ),
    "ExportHF": lambda ch: trainer_pb2_grpc.TrainerStub(ch).ExportHF(
        trainer_pb2.ExportHFRequest(), timeout=5
    ),
    "ApplyWeights": lambda ch: generator_pb2_grpc.GeneratorStub(ch).ApplyWeights(
        generator_pb2.ApplyWeightsRequest(), timeout=5
    ),
    "Sleep": lambda ch: generator_pb2_grpc.GeneratorStub(ch).Sleep(
        generator_pb2.SleepRequest(), timeout=5
    ),
    "WakeUp": lambda ch: generator_pb2_grpc.GeneratorStub(ch).WakeUp(
        generator_pb2.WakeUpRequest(), timeout=5
    ),
}


@pytest.mark.parametrize("role", ["trainer", "generator", "grader"])
def test_only_the_controller_may_train_publish_apply_store_and_sleep(
    stack: Stack, role: str
) -> None:
    """A worker of the run (it holds the secret) is refused every call that changes what is
    trained, served or stored; the controller's reach the servicer (UNIMPLEMENTED here)."""
    with stack.channel(credentials(role, POD)) as worker, stack.channel(credentials()) as ctl:
        assert {n: _code(lambda c=c: c(worker)) for n, c in CONTROLLER_ONLY_CALLS.items()} == (
            dict.fromkeys(CONTROLLER_ONLY_CALLS, grpc.StatusCode.PERMISSION_DENIED)
        )
        assert {n: _code(lambda c=c: c(ctl)) for n, c in CONTROLLER_ONLY_CALLS.items()} == (
            dict.fromkeys(CONTROLLER_ONLY_CALLS, grpc.StatusCode.UNIMPLEMENTED)
        )
        # Reading calls are open to every caller of the run.
        info = trainer_pb2_grpc.TrainerStub(worker).Info
        assert _code(lambda: info(common_pb2.InfoRequest(), timeout=5)) == (
            grpc.StatusCode.UNIMPLEMENTED
        )


def test_a_worker_registers_heartbeats_and_drains_only_as_itself(stack: Stack) -> None:
    with (
        stack.channel(credentials("trainer", POD)) as trainer_of_pod0,
        stack.channel(credentials("grader", POD)) as grader_of_pod0,
        stack.channel(credentials("trainer", "pod-1")) as trainer_of_pod1,
        stack.channel(credentials()) as ctl,
    ):
        as_trainer = controller_pb2_grpc.ControllerStub(trainer_of_pod0)
        as_trainer.Register(_register(), timeout=5)
        for other in (grader_of_pod0, trainer_of_pod1):
            stub = controller_pb2_grpc.ControllerStub(other)
            for call in (
                lambda s=stub: s.Register(_register(), timeout=5),
                lambda s=stub: s.Heartbeat(
                    controller_pb2.HeartbeatRequest(worker_id=POD, component=3, incarnation="i-1"),
                    timeout=5,
                ),
                lambda s=stub: s.Drain(
                    controller_pb2.DrainRequest(worker_id=POD, component=3, incarnation="i-1"),
                    timeout=5,
                ),
            ):
                assert _code(call) == grpc.StatusCode.PERMISSION_DENIED
        # The controller itself may not register as a worker, but may drain one.
        controller = controller_pb2_grpc.ControllerStub(ctl)
        assert _code(lambda: controller.Register(_register(), timeout=5)) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        (member,) = stack.registry.members()
        assert member.state == "serving"
        drained = controller.Drain(
            controller_pb2.DrainRequest(worker_id=POD, component=3, incarnation="i-1"), timeout=5
        )
        assert drained.accepted
        assert stack.registry.members()[0].state == "draining"


# ---- where the secret comes from -----------------------------------------------------------


def test_the_secret_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    value = secrets.token_hex(32)
    (tmp_path / "secret").write_text(f"  {value}\n")  # surrounding whitespace is not part of it
    (tmp_path / "secret").chmod(0o600)  # what podrl up writes (other modes: test_run_secret_file)
    from_file = load_run_secret(AuthConfig(), {"PODRL_RUN_SECRET_FILE": str(tmp_path / "secret")})
    from_env = load_run_secret(AuthConfig(), {"PODRL_RUN_SECRET": value})
    assert from_file is not None and from_env is not None
    assert from_file.value == from_env.value == value.encode()
    assert value not in repr(from_file)
    assert load_run_secret(AuthConfig(disabled=True), {}) is None


def test_with_auth_disabled_a_given_secret_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="podrl.common.auth"):
        assert load_run_secret(AuthConfig(disabled=True), {"PODRL_RUN_SECRET": "x" * 64}) is None
    assert "auth.disabled is true" in caplog.text


@pytest.mark.parametrize(
    ("env", "must_name"),
    [
        ({}, ["PODRL_RUN_SECRET_FILE", "PODRL_RUN_SECRET", "auth.disabled"]),
        ({"PODRL_RUN_SECRET": "short"}, ["PODRL_RUN_SECRET", "at least 32"]),
        ({"PODRL_RUN_SECRET_FILE": "{tmp}/missing"}, ["PODRL_RUN_SECRET_FILE", "{tmp}/missing"]),
        ({"PODRL_RUN_SECRET_FILE": "{tmp}"}, ["PODRL_RUN_SECRET_FILE", "cannot read"]),  # a folder
        (
            {"PODRL_RUN_SECRET_FILE": "{tmp}/missing", "PODRL_RUN_SECRET": "x" * 40},
            ["only one"],
        ),
    ],
    ids=["none", "too short", "missing file", "unreadable", "both"],
)
def test_a_bad_secret_is_refused_naming_the_variable(
    tmp_path: Path, env: dict[str, str], must_name: list[str]
) -> None:
    env = {k: v.format(tmp=tmp_path) for k, v in env.items()}
    with pytest.raises(ConfigError) as err:
        load_run_secret(AuthConfig(), env)
    for text in must_name:
        assert text.format(tmp=tmp_path) in str(err.value)


def test_a_service_without_a_readable_secret_exits_2_before_it_starts(tmp_path: Path) -> None:
    """A missing or unreadable secret file stops the service at start, exit 2, naming the
    variable, without a traceback."""
    port, controller_port = free_ports(2)
    base = {k: v for k, v in os.environ.items() if not k.startswith("PODRL_RUN_SECRET")}
    base.update(
        PODRL_GRADER__GRPC_PORT=str(port),
        PODRL_GRADER__METRICS_PORT="0",
        PODRL_CONTROLLER__GRPC_PORT=str(controller_port),
    )
    for extra, expected in (
        ({}, "no run secret"),
        ({"PODRL_RUN_SECRET_FILE": str(tmp_path / "missing")}, "PODRL_RUN_SECRET_FILE="),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "podrl.grader"],
            env={**base, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert expected in done.stderr and "Traceback" not in done.stderr


def test_with_auth_disabled_nothing_is_checked() -> None:
    """auth.disabled: a service starts without a secret and answers callers without one."""
    running = Stack(_config(auth={"disabled": True}))
    try:
        with running.channel(None) as channel:
            controller_pb2_grpc.ControllerStub(channel).Register(_register(), timeout=5)
        assert [m.worker_id for m in running.registry.members()] == [POD]
    finally:
        running.process.shutdown("test finished")


def test_a_worker_id_the_controller_would_refuse_stops_the_service_at_start() -> None:
    """Every registration under it would be refused (INVALID_ARGUMENT) for as long as the
    service ran; it stops at once instead, naming the variable."""
    port, controller_port = free_ports(2)
    env = {
        **os.environ,
        "PODRL_WORKER_ID": "pod 0/<x>",
        "PODRL_GRADER__GRPC_PORT": str(port),
        "PODRL_GRADER__METRICS_PORT": "0",
        "PODRL_CONTROLLER__GRPC_PORT": str(controller_port),
    }
    done = subprocess.run(
        [sys.executable, "-m", "podrl.grader"], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "worker_id (PODRL_WORKER_ID)" in done.stderr and "letters, digits" in done.stderr
