"""gRPC Controller service: registration, heartbeats, drain notices, status.

Every call has passed the run's authentication (``podrl.common.auth``) before it reaches this
servicer. What depends on the request is checked here: a worker registers, heartbeats and drains
only as itself (its credentials' role is the component it names, its worker id the one it
names); only the controller may drain another worker.
"""

from __future__ import annotations

import logging

import grpc

from podrl.common.auth import CONTROLLER, current_caller, worker_id_problem
from podrl.controller.pods.table import (
    COMPONENT_NAMES,
    STATE_NAMES,
    RegistrationError,
    RegistryFullError,
    WorkerIdTakenError,
    incarnation_problem,
)
from podrl.controller.service.status import RunState, status_to_proto
from podrl.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)


class ControllerServicer(controller_pb2_grpc.ControllerServicer):
    def __init__(self, state: RunState, heartbeat_interval_seconds: float) -> None:
        self._state = state
        self._interval = heartbeat_interval_seconds

    def _check_identity(
        self,
        worker_id: str,
        component: int,
        incarnation: str,
        context: grpc.ServicerContext,
        controller_may_act_for_it: bool = False,
    ) -> None:
        """Refuse a malformed identity (INVALID_ARGUMENT) and a caller acting for another
        process (PERMISSION_DENIED). ``controller_may_act_for_it``: the controller may make
        this call for any worker; otherwise only the worker itself may."""
        problem = worker_id_problem(worker_id)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"worker_id {problem}")
        if component not in COMPONENT_NAMES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"component must be one of GENERATOR, GRADER, TRAINER (got {component})",
            )
        problem = incarnation_problem(incarnation)
        if problem:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"incarnation {problem}")
        caller = current_caller()
        if caller is None:  # auth.disabled: nobody is known
            return
        if controller_may_act_for_it and caller.role == CONTROLLER:
            return
        if caller.role != COMPONENT_NAMES[component] or caller.worker_id != worker_id:
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the {caller.role} of {caller.worker_id!r} may act only as itself, not as the "
                f"{COMPONENT_NAMES[component]} of {worker_id!r}",
            )

    def Register(
        self, request: controller_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> controller_pb2.RegisterResponse:
        self._check_identity(request.worker_id, request.component, request.incarnation, context)
        try:
            self._state.table.register(
                request.worker_id, request.component, request.address, request.incarnation
            )
        except WorkerIdTakenError as err:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(err))
        except RegistryFullError as err:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))
        except RegistrationError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
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
        self._check_identity(request.worker_id, request.component, request.incarnation, context)
        if request.state and request.state not in STATE_NAMES:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"state must be one of STARTING, SERVING, DRAINING, GONE (got {request.state})",
            )
        known = self._state.table.heartbeat(
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
        self._check_identity(
            request.worker_id,
            request.component,
            request.incarnation,
            context,
            controller_may_act_for_it=True,
        )
        accepted = self._state.table.drain(
            request.worker_id, request.component, request.incarnation
        )
        log.info(
            "%s of %s draining (%s)%s",
            COMPONENT_NAMES[request.component],
            request.worker_id,
            request.reason[:200] or "no reason given",
            "" if accepted else ": not the registered process, ignored",
        )
        return controller_pb2.DrainResponse(accepted=accepted)

    def GetStatus(
        self, request: controller_pb2.GetStatusRequest, context: grpc.ServicerContext
    ) -> controller_pb2.RunStatus:
        return status_to_proto(self._state.view())
