"""gRPC Controller service: registration, heartbeats, drain notices, status."""

from __future__ import annotations

import logging

import grpc

from podrl.controller.membership import COMPONENT_NAMES
from podrl.controller.status import RunState, status_to_proto
from podrl.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(self, state: RunState, heartbeat_interval_seconds: float) -> None:
        self._state = state
        self._interval = heartbeat_interval_seconds

    def _check_identity(
        self, worker_id: str, component: int, context: grpc.ServicerContext
    ) -> None:
        if not worker_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "worker_id must not be empty")
        if component not in COMPONENT_NAMES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"component must be one of GENERATOR, GRADER, TRAINER (got {component})",
            )

    def Register(
        self, request: controller_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> controller_pb2.RegisterResponse:
        self._check_identity(request.worker_id, request.component, context)
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address must be host:port")
        self._state.registry.register(
            request.worker_id, request.component, request.address, request.incarnation
        )
        log.info(
            "registered %s of %s at %s",
            COMPONENT_NAMES[request.component],
            request.worker_id,
            request.address,
        )
        return controller_pb2.RegisterResponse(
            heartbeat_interval_seconds=self._interval,
            policy_version=self._state.policy_version,
            run_name=self._state.run_name,
        )

    def Heartbeat(
        self, request: controller_pb2.HeartbeatRequest, context: grpc.ServicerContext
    ) -> controller_pb2.HeartbeatResponse:
        self._check_identity(request.worker_id, request.component, context)
        known = self._state.registry.heartbeat(
            request.worker_id,
            request.component,
            request.incarnation,
            request.state,
            request.policy_version,
        )
        return controller_pb2.HeartbeatResponse(
            registered=known, policy_version=self._state.policy_version
        )

    def Drain(
        self, request: controller_pb2.DrainRequest, context: grpc.ServicerContext
    ) -> controller_pb2.DrainResponse:
        self._check_identity(request.worker_id, request.component, context)
        accepted = self._state.registry.drain(
            request.worker_id, request.component, request.incarnation
        )
        log.info(
            "%s of %s draining (%s)",
            COMPONENT_NAMES[request.component],
            request.worker_id,
            request.reason or "no reason given",
        )
        return controller_pb2.DrainResponse(accepted=accepted)

    def GetStatus(
        self, request: controller_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> controller_pb2.RunStatus:
        return status_to_proto(self._state.view())
