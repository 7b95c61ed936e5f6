"""The controller's registry refuses bad and hostile registrations and stays bounded (addresses
that are not host:port, takeovers, empty incarnations, huge or marked-up ids, floods). Register,
Heartbeat and Drain over real gRPC to a controller servicer in a real ServiceProcess, each
worker with its own run credentials."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from podrl.common.grpc_options import open_channel
from podrl.common.processes import free_ports
from podrl.common.service import ServiceProcess, ServiceSpec
from podrl.config import RunConfig
from podrl.config.transport import GrpcConfig
from podrl.controller.pods.table import PodTable, RegistryFullError
from podrl.controller.service.servicer import ControllerServicer
from podrl.controller.service.status import RunState
from podrl.v1 import controller_pb2, controller_pb2_grpc
from tests.foundation.run_secret import credentials

TRAINER = controller_pb2.COMPONENT_TRAINER
MAX_MEMBERS = 6
TIMEOUT = 0.5  # heartbeat timeout of these tests' registry


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Controller:
    def __init__(self) -> None:
        grpc_port, http_port = free_ports(2)
        config = RunConfig.model_validate(
            {"worker_id": "ctl", "controller": {"grpc_port": grpc_port, "http_port": http_port}}
        )
        self.clock = Clock()
        self.registry = PodTable(
            heartbeat_timeout_seconds=TIMEOUT,
            clock=self.clock,
            max_members=MAX_MEMBERS,
            expire_after_seconds=30,
        )
        self.state = RunState("guards", self.registry, min_worker_pods=1)
        servicer = ControllerServicer(self.state, heartbeat_interval_seconds=1)
        spec = ServiceSpec(
            "controller",
            "podrl.v1.Controller",
            config.controller,
            lambda server: controller_pb2_grpc.add_ControllerServicer_to_server(servicer, server),
        )
        self.process = ServiceProcess(spec, config)
        self.process.start()
        self.address = config.controller.address
        self._channels: list[grpc.Channel] = []

    def stub(self, worker_id: str, role: str = "trainer") -> controller_pb2_grpc.ControllerStub:
        channel = open_channel(self.address, GrpcConfig(), credentials(role, worker_id))
        self._channels.append(channel)
        return controller_pb2_grpc.ControllerStub(channel)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()
        self.process.shutdown("test finished")


@pytest.fixture
def controller() -> Iterator[Controller]:
    running = Controller()
    yield running
    running.close()


def _register(
    stub: controller_pb2_grpc.ControllerStub,
    worker_id: str,
    address: str = "127.0.0.1:50053",
    incarnation: str = "i-1",
) -> controller_pb2.RegisterResponse:
    return stub.Register(
        controller_pb2.RegisterRequest(
            worker_id=worker_id, component=TRAINER, address=address, incarnation=incarnation
        ),
        timeout=5,
    )


def _refused(call, code: grpc.StatusCode, *words: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    for word in words:
        assert word in err.value.details()


@pytest.mark.parametrize(
    "address",
    ["not an address", "host", ":50053", "host:0", "host:70000", "host:+5", "a b:1", "[::1x]:5"],
)
def test_register_refuses_what_is_not_host_port(controller: Controller, address: str) -> None:
    """Before this check: 'not an address' was accepted and listed healthy."""
    stub = controller.stub("pod-0")
    _refused(lambda: _register(stub, "pod-0", address), grpc.StatusCode.INVALID_ARGUMENT, "address")
    assert controller.registry.members() == []


@pytest.mark.parametrize(
    "address", ["127.0.0.1:1", "trainer:50053", "w-0.podrl-workers.ns.svc:65535", "[::1]:50053"]
)
def test_register_accepts_addresses_workers_have(controller: Controller, address: str) -> None:
    _register(controller.stub("pod-0"), "pod-0", address)
    assert [m.address for m in controller.registry.members()] == [address]


def test_a_live_worker_id_is_not_taken_over_from_another_address(controller: Controller) -> None:
    """Before this check: a Register with an existing worker id at another address replaced the real
    trainer's entry. Now it is refused while the holder lives; it may take the place once the
    holder drained or stopped heartbeating; a restart at the same address always may."""
    stub = controller.stub("pod-0")
    _register(stub, "pod-0", "10.0.0.1:50053", "real")
    _refused(
        lambda: _register(stub, "pod-0", "10.0.0.9:50053", "intruder"),
        grpc.StatusCode.ALREADY_EXISTS,
        "10.0.0.1:50053",
        "heartbeat_timeout_seconds",
    )
    (member,) = controller.registry.members()
    assert (member.address, member.state) == ("10.0.0.1:50053", "serving")
    # The same process restarted (same address, new incarnation): it is the holder.
    _register(stub, "pod-0", "10.0.0.1:50053", "restarted")
    # Heartbeats stopped for longer than the timeout: another address may register.
    controller.clock.now += TIMEOUT + 0.1
    _register(stub, "pod-0", "10.0.0.2:50053", "moved")
    assert controller.registry.members()[0].address == "10.0.0.2:50053"
    # Drained: the next one may register at once.
    stub.Drain(
        controller_pb2.DrainRequest(worker_id="pod-0", component=TRAINER, incarnation="moved"),
        timeout=5,
    )
    _register(stub, "pod-0", "10.0.0.3:50053", "next")
    assert controller.registry.members()[0].address == "10.0.0.3:50053"


def test_drain_without_an_incarnation_is_refused(controller: Controller) -> None:
    """Before this check: a Drain with an empty incarnation was accepted and made /readyz 503."""
    stub = controller.stub("pod-0")
    _register(stub, "pod-0")
    _refused(
        lambda: stub.Drain(
            controller_pb2.DrainRequest(worker_id="pod-0", component=TRAINER), timeout=5
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "incarnation",
    )
    wrong = stub.Drain(
        controller_pb2.DrainRequest(worker_id="pod-0", component=TRAINER, incarnation="other"),
        timeout=5,
    )
    assert not wrong.accepted
    assert controller.registry.members()[0].state == "serving"


@pytest.mark.parametrize(
    ("worker_id", "words"),
    [
        ("w" * 1_000_000, ["worker_id", "at most 253"]),
        ("<img src=x onerror=alert(1)>", ["worker_id", "letters, digits"]),
        ("", ["worker_id", "empty"]),
    ],
    ids=["1 MB", "markup", "empty"],
)
def test_worker_ids_are_bounded_and_plain(
    controller: Controller, worker_id: str, words: list[str]
) -> None:
    """Before these checks a 1 MB worker id was kept forever and markup was taken as a worker
    id. The credentials cannot carry such an id, so the call is made as the controller: the id is
    checked before who may register it."""
    stub = controller.stub("ctl", role="controller")
    request = controller_pb2.RegisterRequest(
        worker_id=worker_id, component=TRAINER, address="127.0.0.1:1", incarnation="i"
    )
    _refused(lambda: stub.Register(request, timeout=5), grpc.StatusCode.INVALID_ARGUMENT, *words)
    assert controller.registry.members() == []


def test_the_registry_is_bounded_and_forgets_gone_workers(controller: Controller) -> None:
    """Before these checks 2000 fake registrations were all kept, and no entry was ever
    removed. Now at most max_members are kept; a member silent past expire_after_seconds is
    forgotten, which frees its place."""
    for n in range(MAX_MEMBERS):
        _register(controller.stub(f"pod-{n}"), f"pod-{n}")
    _refused(
        lambda: _register(controller.stub("pod-extra"), "pod-extra"),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        str(MAX_MEMBERS),
    )
    assert len(controller.state.view().workers) == MAX_MEMBERS
    # Re-registering a member that is in already is no growth: allowed when full.
    _register(controller.stub("pod-0"), "pod-0")
    controller.clock.now += 31  # every member silent past expire_after_seconds (30)
    assert controller.state.view().workers == []
    _register(controller.stub("pod-extra"), "pod-extra")
    assert [w.worker_id for w in controller.state.view().workers] == ["pod-extra"]


def test_a_heartbeat_with_an_unknown_state_is_refused(controller: Controller) -> None:
    stub = controller.stub("pod-0")
    _register(stub, "pod-0")
    request = controller_pb2.HeartbeatRequest(
        worker_id="pod-0", component=TRAINER, incarnation="i-1", state=99
    )
    _refused(lambda: stub.Heartbeat(request, timeout=5), grpc.StatusCode.INVALID_ARGUMENT, "state")
    assert controller.registry.members()[0].state == "serving"


@pytest.mark.parametrize(("timeout", "expiry"), [(10.0, 60.0), (1.0, 60.0), (20.0, 120.0)])
def test_by_default_members_expire_after_six_heartbeat_timeouts_at_least_a_minute(
    timeout: float, expiry: float
) -> None:
    clock = Clock()
    registry = PodTable(heartbeat_timeout_seconds=timeout, clock=clock)
    registry.register("pod-0", TRAINER, "127.0.0.1:1", "i")
    clock.now += expiry - 0.5
    assert [m.worker_id for m in registry.members()] == ["pod-0"]
    clock.now += 1.0
    assert registry.members() == []


def test_by_default_the_registry_holds_3072_processes() -> None:
    registry = PodTable(heartbeat_timeout_seconds=10)
    for n in range(1024):
        for component in (1, 2, 3):
            registry.register(f"pod-{n}", component, "127.0.0.1:1", "i")
    with pytest.raises(RegistryFullError):
        registry.register("pod-1024", TRAINER, "127.0.0.1:1", "i")
    assert len(registry.members()) == 3072
