from podrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_ERROR_NONE: _ClassVar[ScoreError]
    SCORE_ERROR_EXCEPTION: _ClassVar[ScoreError]
    SCORE_ERROR_TIMEOUT: _ClassVar[ScoreError]
    SCORE_ERROR_WORKER_DIED: _ClassVar[ScoreError]
    SCORE_ERROR_UNKNOWN_TASK: _ClassVar[ScoreError]
    SCORE_ERROR_ENVIRONMENT: _ClassVar[ScoreError]
SCORE_ERROR_NONE: ScoreError
SCORE_ERROR_EXCEPTION: ScoreError
SCORE_ERROR_TIMEOUT: ScoreError
SCORE_ERROR_WORKER_DIED: ScoreError
SCORE_ERROR_UNKNOWN_TASK: ScoreError
SCORE_ERROR_ENVIRONMENT: ScoreError

class ScoreItem(_message.Message):
    __slots__ = ("id", "prompt", "completion", "reference", "task", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    id: str
    prompt: str
    completion: str
    reference: str
    task: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., reference: _Optional[str] = ..., task: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ScoreItem]
    def __init__(self, items: _Optional[_Iterable[_Union[ScoreItem, _Mapping]]] = ...) -> None: ...

class ItemScore(_message.Message):
    __slots__ = ("id", "reward", "components", "error", "error_message", "latency_seconds")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    reward: float
    components: _containers.ScalarMap[str, float]
    error: ScoreError
    error_message: str
    latency_seconds: float
    def __init__(self, id: _Optional[str] = ..., reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., error: _Optional[_Union[ScoreError, str]] = ..., error_message: _Optional[str] = ..., latency_seconds: _Optional[float] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("scores",)
    SCORES_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[ItemScore]
    def __init__(self, scores: _Optional[_Iterable[_Union[ItemScore, _Mapping]]] = ...) -> None: ...

class TaskRewardInfo(_message.Message):
    __slots__ = ("task", "components", "weights", "sources", "fallback_reward")
    TASK_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    FALLBACK_REWARD_FIELD_NUMBER: _ClassVar[int]
    task: str
    components: _containers.RepeatedScalarFieldContainer[str]
    weights: _containers.RepeatedScalarFieldContainer[float]
    sources: _containers.RepeatedScalarFieldContainer[str]
    fallback_reward: float
    def __init__(self, task: _Optional[str] = ..., components: _Optional[_Iterable[str]] = ..., weights: _Optional[_Iterable[float]] = ..., sources: _Optional[_Iterable[str]] = ..., fallback_reward: _Optional[float] = ...) -> None: ...

class GraderInfo(_message.Message):
    __slots__ = ("info", "tasks", "reward_functions", "task_rewards", "item_timeout_seconds", "workers")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FUNCTIONS_FIELD_NUMBER: _ClassVar[int]
    TASK_REWARDS_FIELD_NUMBER: _ClassVar[int]
    ITEM_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    tasks: _containers.RepeatedScalarFieldContainer[str]
    reward_functions: _containers.RepeatedScalarFieldContainer[str]
    task_rewards: _containers.RepeatedCompositeFieldContainer[TaskRewardInfo]
    item_timeout_seconds: float
    workers: int
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., tasks: _Optional[_Iterable[str]] = ..., reward_functions: _Optional[_Iterable[str]] = ..., task_rewards: _Optional[_Iterable[_Union[TaskRewardInfo, _Mapping]]] = ..., item_timeout_seconds: _Optional[float] = ..., workers: _Optional[int] = ...) -> None: ...
