from podrl.v1 import common_pb2 as _common_pb2
from podrl.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompts", "sampling", "request_id")
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prompt]
    sampling: _common_pb2.SamplingParams
    request_id: str
    def __init__(self, prompts: _Optional[_Iterable[_Union[_common_pb2.Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., request_id: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("samples", "policy_version", "prompt_tokens", "completion_tokens")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    policy_version: int
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., policy_version: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class ApplyWeightsRequest(_message.Message):
    __slots__ = ("manifest", "rollback", "in_flight")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    manifest: _weights_pb2.WeightManifest
    rollback: bool
    in_flight: bool
    def __init__(self, manifest: _Optional[_Union[_weights_pb2.WeightManifest, _Mapping]] = ..., rollback: _Optional[bool] = ..., in_flight: _Optional[bool] = ...) -> None: ...

class ApplyWeightsResponse(_message.Message):
    __slots__ = ("policy_version", "apply_seconds", "plan_cached", "in_flight")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    APPLY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLAN_CACHED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    apply_seconds: float
    plan_cached: bool
    in_flight: bool
    def __init__(self, policy_version: _Optional[int] = ..., apply_seconds: _Optional[float] = ..., plan_cached: _Optional[bool] = ..., in_flight: _Optional[bool] = ...) -> None: ...

class SleepRequest(_message.Message):
    __slots__ = ("level",)
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    level: int
    def __init__(self, level: _Optional[int] = ...) -> None: ...

class SleepResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WakeUpResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GeneratorInfo(_message.Message):
    __slots__ = ("info", "model", "policy_version", "tensor_parallel_size", "device", "dtype", "sleeping", "weight_state", "in_flight_apply")
    INFO_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SLEEPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_STATE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_APPLY_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    model: str
    policy_version: int
    tensor_parallel_size: int
    device: str
    dtype: str
    sleeping: bool
    weight_state: str
    in_flight_apply: str
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., model: _Optional[str] = ..., policy_version: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., sleeping: _Optional[bool] = ..., weight_state: _Optional[str] = ..., in_flight_apply: _Optional[str] = ...) -> None: ...
