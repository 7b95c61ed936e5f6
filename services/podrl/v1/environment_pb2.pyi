from podrl.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ResetRequest(_message.Message):
    __slots__ = ("episode_id", "environment", "prompt", "reference", "metadata", "seed")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    environment: str
    prompt: str
    reference: str
    metadata: _containers.ScalarMap[str, str]
    seed: int
    def __init__(self, episode_id: _Optional[str] = ..., environment: _Optional[str] = ..., prompt: _Optional[str] = ..., reference: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., seed: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("observation", "observation_truncated")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    observation: str
    observation_truncated: bool
    def __init__(self, observation: _Optional[str] = ..., observation_truncated: _Optional[bool] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "action")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    action: str
    def __init__(self, episode_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "observation_truncated", "reward", "done", "truncated", "turn", "tool_calls", "tool_errors", "latency_seconds")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    observation: str
    observation_truncated: bool
    reward: float
    done: bool
    truncated: bool
    turn: int
    tool_calls: int
    tool_errors: int
    latency_seconds: float
    def __init__(self, observation: _Optional[str] = ..., observation_truncated: _Optional[bool] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., truncated: _Optional[bool] = ..., turn: _Optional[int] = ..., tool_calls: _Optional[int] = ..., tool_errors: _Optional[int] = ..., latency_seconds: _Optional[float] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class EnvironmentInfo(_message.Message):
    __slots__ = ("info", "environments", "sources", "sessions", "max_sessions", "max_turns", "max_episode_tokens", "step_timeout_seconds", "max_tool_output_chars", "workers")
    INFO_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOOL_OUTPUT_CHARS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    environments: _containers.RepeatedScalarFieldContainer[str]
    sources: _containers.RepeatedScalarFieldContainer[str]
    sessions: int
    max_sessions: int
    max_turns: int
    max_episode_tokens: int
    step_timeout_seconds: float
    max_tool_output_chars: int
    workers: int
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., environments: _Optional[_Iterable[str]] = ..., sources: _Optional[_Iterable[str]] = ..., sessions: _Optional[int] = ..., max_sessions: _Optional[int] = ..., max_turns: _Optional[int] = ..., max_episode_tokens: _Optional[int] = ..., step_timeout_seconds: _Optional[float] = ..., max_tool_output_chars: _Optional[int] = ..., workers: _Optional[int] = ...) -> None: ...
