"""Every service answers the standard grpc.health.v1 protocol over a real socket."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from podrl.cli.local_cluster import LocalCluster
from podrl.common.grpc_options import open_channel
from podrl.config.transport import GrpcConfig

SERVICES = ["controller", "generator", "grader", "trainer"]


def _check(address: str, service: str) -> health_pb2.HealthCheckResponse:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )


@pytest.mark.parametrize("name", SERVICES)
def test_overall_and_named_service_are_serving(cluster: LocalCluster, name: str) -> None:
    child = next(c for c in cluster.children if c.name == name)
    for service in ("", f"podrl.v1.{name.capitalize()}"):
        reply = _check(child.grpc_address, service)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, (name, service)


@pytest.mark.parametrize("name", SERVICES)
def test_unknown_service_name_is_not_found(cluster: LocalCluster, name: str) -> None:
    child = next(c for c in cluster.children if c.name == name)
    with pytest.raises(grpc.RpcError) as err:
        _check(child.grpc_address, "podrl.v1.NoSuchService")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_lists_the_service(cluster: LocalCluster) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    child = next(c for c in cluster.children if c.name == "grader")
    with grpc.insecure_channel(child.grpc_address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert "podrl.v1.Grader" in names
    assert "grpc.health.v1.Health" in names


def test_every_worker_registered_with_the_controller(cluster: LocalCluster) -> None:
    from podrl.v1 import controller_pb2, controller_pb2_grpc

    controller = next(c for c in cluster.children if c.name == "controller")
    with open_channel(controller.grpc_address, GrpcConfig(), cluster.credentials()) as channel:
        status = controller_pb2_grpc.ControllerStub(channel).GetStatus(
            controller_pb2.GetStatusRequest(), timeout=5
        )
    components = {w.component for w in status.workers if w.healthy}
    assert components == {
        controller_pb2.COMPONENT_GENERATOR,
        controller_pb2.COMPONENT_GRADER,
        controller_pb2.COMPONENT_TRAINER,
    }
    assert status.ready
