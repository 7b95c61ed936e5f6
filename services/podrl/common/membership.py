"""Worker side of membership: register with the controller, heartbeat, announce a drain."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

import grpc

from podrl.common.auth import CallerCredentials
from podrl.common.grpc_options import open_channel
from podrl.config.run_config import RunConfig
from podrl.v1 import common_pb2, controller_pb2, controller_pb2_grpc

log = logging.getLogger(__name__)

#: Answers to Register that mean "not like this" rather than "not now".
_REFUSALS = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class MembershipClient:
    """Keeps one service process registered with the controller.

    Registration is retried with capped back-off (the controller may start after the worker or
    restart mid-run); a heartbeat answered with ``registered=False`` triggers a new registration.
    Every call carries a deadline, so a dead controller never blocks the worker, and the
    process's run credentials (``credentials``; None only when the run's auth is disabled).
    """

    def __init__(
        self,
        config: RunConfig,
        component: controller_pb2.Component.ValueType,
        address: str,
        info: common_pb2.ServiceInfo,
        policy_version: Callable[[], int] | None = None,
        credentials: CallerCredentials | None = None,
    ) -> None:
        self._config = config
        self._component = component
        self._address = address
        self._info = info
        self._policy_version = policy_version or (lambda: 0)
        self._incarnation = uuid.uuid4().hex
        self._stop = threading.Event()
        self._state = controller_pb2.WORKER_STATE_SERVING
        self._interval = config.controller.heartbeat_interval_seconds
        self._timeout = min(config.grpc.call_timeout_seconds, 5.0)
        self._channel = open_channel(config.controller.address, config.grpc, credentials)
        self._stub = controller_pb2_grpc.ControllerStub(self._channel)
        self._thread = threading.Thread(target=self._run, name="membership", daemon=True)
        self.registered = threading.Event()

    def start(self) -> None:
        self._thread.start()

    def _register(self) -> bool:
        try:
            reply = self._stub.Register(
                controller_pb2.RegisterRequest(
                    worker_id=self._config.worker_id,
                    component=self._component,
                    address=self._address,
                    info=self._info,
                    incarnation=self._incarnation,
                ),
                timeout=self._timeout,
            )
        except grpc.RpcError as err:
            if err.code() in _REFUSALS:  # retrying will not help until someone fixes it: say so
                log.warning("the controller refused the registration: %s", err.details())
            else:  # not up yet, or restarting
                log.debug("register with controller failed: %s", err.code())
            return False
        self._interval = reply.heartbeat_interval_seconds or self._interval
        self.registered.set()
        log.info("registered with controller %s", self._config.controller.address)
        return True

    def _heartbeat(self) -> None:
        try:
            reply = self._stub.Heartbeat(
                controller_pb2.HeartbeatRequest(
                    worker_id=self._config.worker_id,
                    component=self._component,
                    state=self._state,
                    incarnation=self._incarnation,
                    policy_version=self._policy_version(),
                ),
                timeout=self._timeout,
            )
        except grpc.RpcError as err:
            log.warning("heartbeat to controller failed: %s", err.code())
            return
        if not reply.registered:
            log.info("controller does not know this process (restarted?); registering again")
            self.registered.clear()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            if not self.registered.is_set():
                if self._register():
                    backoff = 0.1
                else:
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, self._interval)
                    continue
            else:
                self._heartbeat()
            self._stop.wait(self._interval)

    def drain(self, reason: str) -> None:
        """Tell the controller this process is leaving; best effort, bounded by a deadline."""
        self._state = controller_pb2.WORKER_STATE_DRAINING
        self._stop.set()
        if not self.registered.is_set():
            return
        try:
            self._stub.Drain(
                controller_pb2.DrainRequest(
                    worker_id=self._config.worker_id,
                    component=self._component,
                    reason=reason,
                    incarnation=self._incarnation,
                ),
                timeout=min(self._timeout, 2.0),
            )
        except grpc.RpcError as err:
            log.warning("drain notice to controller failed: %s", err.code())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._timeout + 1)
        self._channel.close()
