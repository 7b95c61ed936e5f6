from podrl.v1 import common_pb2 as _common_pb2
from podrl.v1 import weights_pb2 as _weights_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RankErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RANK_ERROR_KIND_INTERNAL: _ClassVar[RankErrorKind]
    RANK_ERROR_KIND_INVALID_REQUEST: _ClassVar[RankErrorKind]
    RANK_ERROR_KIND_NOT_NOW: _ClassVar[RankErrorKind]
    RANK_ERROR_KIND_NON_FINITE_STEP: _ClassVar[RankErrorKind]
    RANK_ERROR_KIND_STEP_ABORTED: _ClassVar[RankErrorKind]
    RANK_ERROR_KIND_NO_SPACE: _ClassVar[RankErrorKind]
RANK_ERROR_KIND_INTERNAL: RankErrorKind
RANK_ERROR_KIND_INVALID_REQUEST: RankErrorKind
RANK_ERROR_KIND_NOT_NOW: RankErrorKind
RANK_ERROR_KIND_NON_FINITE_STEP: RankErrorKind
RANK_ERROR_KIND_STEP_ABORTED: RankErrorKind
RANK_ERROR_KIND_NO_SPACE: RankErrorKind

class TrainSequence(_message.Message):
    __slots__ = ("sample_id", "prompt_ids", "completion_ids", "generator_logprobs", "advantage", "policy_version", "completion_mask")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_MASK_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_ids: _containers.RepeatedScalarFieldContainer[int]
    generator_logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantage: float
    policy_version: int
    completion_mask: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sample_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., completion_ids: _Optional[_Iterable[int]] = ..., generator_logprobs: _Optional[_Iterable[float]] = ..., advantage: _Optional[float] = ..., policy_version: _Optional[int] = ..., completion_mask: _Optional[_Iterable[int]] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("sequences", "policy_version", "batch_id", "global_sequences", "global_completion_tokens", "pods", "pod_ids")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    POD_IDS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[TrainSequence]
    policy_version: int
    batch_id: str
    global_sequences: int
    global_completion_tokens: int
    pods: int
    pod_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, sequences: _Optional[_Iterable[_Union[TrainSequence, _Mapping]]] = ..., policy_version: _Optional[int] = ..., batch_id: _Optional[str] = ..., global_sequences: _Optional[int] = ..., global_completion_tokens: _Optional[int] = ..., pods: _Optional[int] = ..., pod_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class TrainMetrics(_message.Message):
    __slots__ = ("loss", "pg_loss", "kl", "entropy", "ratio_mean", "clip_fraction", "grad_norm", "logprob_diff_mean", "logprob_diff_max", "tokens", "learning_rate", "step_seconds", "clip_fraction_low", "clip_fraction_high", "clip_fraction_dual", "ratio_min", "ratio_max", "is_weight_mean", "is_weight_min", "is_weight_max", "is_masked_fraction", "is_truncated_fraction", "mismatch_kl", "update_ratio")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PG_LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    RATIO_MEAN_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_DIFF_MEAN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_DIFF_MAX_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_HIGH_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_DUAL_FIELD_NUMBER: _ClassVar[int]
    RATIO_MIN_FIELD_NUMBER: _ClassVar[int]
    RATIO_MAX_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_MIN_FIELD_NUMBER: _ClassVar[int]
    IS_WEIGHT_MAX_FIELD_NUMBER: _ClassVar[int]
    IS_MASKED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    IS_TRUNCATED_FRACTION_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_KL_FIELD_NUMBER: _ClassVar[int]
    UPDATE_RATIO_FIELD_NUMBER: _ClassVar[int]
    loss: float
    pg_loss: float
    kl: float
    entropy: float
    ratio_mean: float
    clip_fraction: float
    grad_norm: float
    logprob_diff_mean: float
    logprob_diff_max: float
    tokens: int
    learning_rate: float
    step_seconds: float
    clip_fraction_low: float
    clip_fraction_high: float
    clip_fraction_dual: float
    ratio_min: float
    ratio_max: float
    is_weight_mean: float
    is_weight_min: float
    is_weight_max: float
    is_masked_fraction: float
    is_truncated_fraction: float
    mismatch_kl: float
    update_ratio: float
    def __init__(self, loss: _Optional[float] = ..., pg_loss: _Optional[float] = ..., kl: _Optional[float] = ..., entropy: _Optional[float] = ..., ratio_mean: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., grad_norm: _Optional[float] = ..., logprob_diff_mean: _Optional[float] = ..., logprob_diff_max: _Optional[float] = ..., tokens: _Optional[int] = ..., learning_rate: _Optional[float] = ..., step_seconds: _Optional[float] = ..., clip_fraction_low: _Optional[float] = ..., clip_fraction_high: _Optional[float] = ..., clip_fraction_dual: _Optional[float] = ..., ratio_min: _Optional[float] = ..., ratio_max: _Optional[float] = ..., is_weight_mean: _Optional[float] = ..., is_weight_min: _Optional[float] = ..., is_weight_max: _Optional[float] = ..., is_masked_fraction: _Optional[float] = ..., is_truncated_fraction: _Optional[float] = ..., mismatch_kl: _Optional[float] = ..., update_ratio: _Optional[float] = ...) -> None: ...

class TrainResponse(_message.Message):
    __slots__ = ("metrics", "policy_version", "step")
    METRICS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    metrics: TrainMetrics
    policy_version: int
    step: int
    def __init__(self, metrics: _Optional[_Union[TrainMetrics, _Mapping]] = ..., policy_version: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class PublishWeightsRequest(_message.Message):
    __slots__ = ("force_full",)
    FORCE_FULL_FIELD_NUMBER: _ClassVar[int]
    force_full: bool
    def __init__(self, force_full: _Optional[bool] = ...) -> None: ...

class PublishWeightsResponse(_message.Message):
    __slots__ = ("manifest",)
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    manifest: _weights_pb2.WeightManifest
    def __init__(self, manifest: _Optional[_Union[_weights_pb2.WeightManifest, _Mapping]] = ...) -> None: ...

class AcknowledgeWeightsRequest(_message.Message):
    __slots__ = ("version", "generator_id")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_ID_FIELD_NUMBER: _ClassVar[int]
    version: int
    generator_id: str
    def __init__(self, version: _Optional[int] = ..., generator_id: _Optional[str] = ...) -> None: ...

class AcknowledgeWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path", "controller_state")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_STATE_FIELD_NUMBER: _ClassVar[int]
    path: str
    controller_state: bytes
    def __init__(self, path: _Optional[str] = ..., controller_state: _Optional[bytes] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "step", "policy_version")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    policy_version: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("step", "policy_version", "controller_state")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_STATE_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    controller_state: bytes
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., controller_state: _Optional[bytes] = ...) -> None: ...

class ExportHFRequest(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class ExportHFResponse(_message.Message):
    __slots__ = ("path", "files")
    PATH_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    path: str
    files: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., files: _Optional[_Iterable[str]] = ...) -> None: ...

class MeshInfo(_message.Message):
    __slots__ = ("shape", "dim_names", "device_type")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIM_NAMES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dim_names: _containers.RepeatedScalarFieldContainer[str]
    device_type: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dim_names: _Optional[_Iterable[str]] = ..., device_type: _Optional[str] = ...) -> None: ...

class TrainerInfo(_message.Message):
    __slots__ = ("info", "model", "policy_version", "step", "world_size", "mesh", "last_batch_id", "last_train")
    INFO_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    LAST_BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_TRAIN_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ServiceInfo
    model: str
    policy_version: int
    step: int
    world_size: int
    mesh: MeshInfo
    last_batch_id: str
    last_train: TrainResponse
    def __init__(self, info: _Optional[_Union[_common_pb2.ServiceInfo, _Mapping]] = ..., model: _Optional[str] = ..., policy_version: _Optional[int] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., mesh: _Optional[_Union[MeshInfo, _Mapping]] = ..., last_batch_id: _Optional[str] = ..., last_train: _Optional[_Union[TrainResponse, _Mapping]] = ...) -> None: ...

class ParametersDigestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ParametersDigestResponse(_message.Message):
    __slots__ = ("policy_version", "step", "sha256")
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    policy_version: int
    step: int
    sha256: str
    def __init__(self, policy_version: _Optional[int] = ..., step: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class RankCommand(_message.Message):
    __slots__ = ("name", "payload")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    name: str
    payload: bytes
    def __init__(self, name: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class RankReply(_message.Message):
    __slots__ = ("error", "payload", "error_kind", "error_message")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ERROR_KIND_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    error: str
    payload: bytes
    error_kind: RankErrorKind
    error_message: str
    def __init__(self, error: _Optional[str] = ..., payload: _Optional[bytes] = ..., error_kind: _Optional[_Union[RankErrorKind, str]] = ..., error_message: _Optional[str] = ...) -> None: ...
