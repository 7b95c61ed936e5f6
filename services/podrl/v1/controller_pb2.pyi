from podrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Component(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPONENT_UNSPECIFIED: _ClassVar[Component]
    COMPONENT_GENERATOR: _ClassVar[Component]
    COMPONENT_GRADER: _ClassVar[Component]
    COMPONENT_TRAINER: _ClassVar[Component]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_SERVING: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_GONE: _ClassVar[WorkerState]
COMPONENT_UNSPECIFIED: Component
COMPONENT_GENERATOR: Component
COMPONENT_GRADER: Component
COMPONENT_TRAINER: Component
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_SERVING: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_GONE: WorkerState

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "component", "address", "info", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    component: Component
    address: str
    info: _common_pb2.ServiceInfo
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., component: _Optional[_Union[Component, str]] = ..., address: _Optional[str] = ..., info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_seconds", "policy_version", "run_name")
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_seconds: float
    policy_version: int
    run_name: str
    def __init__(self, heartbeat_interval_seconds: _Optional[float] = ..., policy_version: _Optional[int] = ..., run_name: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "component", "state", "incarnation", "policy_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    component: Component
    state: WorkerState
    incarnation: str
    policy_version: int
    def __init__(self, worker_id: _Optional[str] = ..., component: _Optional[_Union[Component, str]] = ..., state: _Optional[_Union[WorkerState, str]] = ..., incarnation: _Optional[str] = ..., policy_version: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("registered", "policy_version")
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    registered: bool
    policy_version: int
    def __init__(self, registered: _Optional[bool] = ..., policy_version: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("worker_id", "component", "reason", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    component: Component
    reason: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., component: _Optional[_Union[Component, str]] = ..., reason: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "component", "address", "state", "healthy", "seconds_since_heartbeat", "policy_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    component: Component
    address: str
    state: WorkerState
    healthy: bool
    seconds_since_heartbeat: float
    policy_version: int
    def __init__(self, worker_id: _Optional[str] = ..., component: _Optional[_Union[Component, str]] = ..., address: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., healthy: _Optional[bool] = ..., seconds_since_heartbeat: _Optional[float] = ..., policy_version: _Optional[int] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("run_name", "phase", "step", "policy_version", "ready", "workers", "phase_seconds", "uptime_seconds")
    class PhaseSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_NAME_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    run_name: str
    phase: str
    step: int
    policy_version: int
    ready: bool
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    phase_seconds: _containers.ScalarMap[str, float]
    uptime_seconds: float
    def __init__(self, run_name: _Optional[str] = ..., phase: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., ready: _Optional[bool] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., phase_seconds: _Optional[_Mapping[str, float]] = ..., uptime_seconds: _Optional[float] = ...) -> None: ...
