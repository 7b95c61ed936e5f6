from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]

class DeviceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_TYPE_UNSPECIFIED: _ClassVar[DeviceType]
    DEVICE_TYPE_CPU: _ClassVar[DeviceType]
    DEVICE_TYPE_CUDA: _ClassVar[DeviceType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT64: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_INT16: DType
DTYPE_INT8: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
DTYPE_FLOAT8_E4M3FN: DType
DTYPE_FLOAT8_E5M2: DType
DEVICE_TYPE_UNSPECIFIED: DeviceType
DEVICE_TYPE_CPU: DeviceType
DEVICE_TYPE_CUDA: DeviceType

class Mesh(_message.Message):
    __slots__ = ("shape", "dim_names", "device_type")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DIM_NAMES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TYPE_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dim_names: _containers.RepeatedScalarFieldContainer[str]
    device_type: DeviceType
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dim_names: _Optional[_Iterable[str]] = ..., device_type: _Optional[_Union[DeviceType, str]] = ...) -> None: ...

class ShardPlacement(_message.Message):
    __slots__ = ("dim", "split_factor")
    DIM_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FACTOR_FIELD_NUMBER: _ClassVar[int]
    dim: int
    split_factor: int
    def __init__(self, dim: _Optional[int] = ..., split_factor: _Optional[int] = ...) -> None: ...

class ReplicatePlacement(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PartialPlacement(_message.Message):
    __slots__ = ("reduce_op",)
    REDUCE_OP_FIELD_NUMBER: _ClassVar[int]
    reduce_op: str
    def __init__(self, reduce_op: _Optional[str] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("shard", "replicate", "partial")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    shard: ShardPlacement
    replicate: ReplicatePlacement
    partial: PartialPlacement
    def __init__(self, shard: _Optional[_Union[ShardPlacement, _Mapping]] = ..., replicate: _Optional[_Union[ReplicatePlacement, _Mapping]] = ..., partial: _Optional[_Union[PartialPlacement, _Mapping]] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("device_uuid", "handle", "offset", "nbytes", "allocation_nbytes", "event_handle", "ref_counter_handle", "ref_counter_offset", "event_sync_required", "tensor_offset")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_NBYTES_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    handle: bytes
    offset: int
    nbytes: int
    allocation_nbytes: int
    event_handle: bytes
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_sync_required: bool
    tensor_offset: int
    def __init__(self, device_uuid: _Optional[str] = ..., handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., allocation_nbytes: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_sync_required: _Optional[bool] = ..., tensor_offset: _Optional[int] = ...) -> None: ...

class ShmHandle(_message.Message):
    __slots__ = ("name", "offset", "nbytes", "segment_nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    nbytes: int
    segment_nbytes: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., segment_nbytes: _Optional[int] = ...) -> None: ...

class TensorStorage(_message.Message):
    __slots__ = ("cuda_ipc", "shm")
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    cuda_ipc: CudaIpcHandle
    shm: ShmHandle
    def __init__(self, cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., shm: _Optional[_Union[ShmHandle, _Mapping]] = ...) -> None: ...

class TensorShard(_message.Message):
    __slots__ = ("name", "dtype", "global_shape", "local_shape", "local_offset", "stride", "mesh", "mesh_coordinate", "placements", "storage", "publisher_rank")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GLOBAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    MESH_FIELD_NUMBER: _ClassVar[int]
    MESH_COORDINATE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_RANK_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    global_shape: _containers.RepeatedScalarFieldContainer[int]
    local_shape: _containers.RepeatedScalarFieldContainer[int]
    local_offset: _containers.RepeatedScalarFieldContainer[int]
    stride: _containers.RepeatedScalarFieldContainer[int]
    mesh: Mesh
    mesh_coordinate: _containers.RepeatedScalarFieldContainer[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    storage: TensorStorage
    publisher_rank: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., global_shape: _Optional[_Iterable[int]] = ..., local_shape: _Optional[_Iterable[int]] = ..., local_offset: _Optional[_Iterable[int]] = ..., stride: _Optional[_Iterable[int]] = ..., mesh: _Optional[_Union[Mesh, _Mapping]] = ..., mesh_coordinate: _Optional[_Iterable[int]] = ..., placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., storage: _Optional[_Union[TensorStorage, _Mapping]] = ..., publisher_rank: _Optional[int] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("version", "model_fingerprint", "shards", "version_only", "publisher_id", "mac")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_ONLY_FIELD_NUMBER: _ClassVar[int]
    PUBLISHER_ID_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    version: int
    model_fingerprint: str
    shards: _containers.RepeatedCompositeFieldContainer[TensorShard]
    version_only: bool
    publisher_id: str
    mac: bytes
    def __init__(self, version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[TensorShard, _Mapping]]] = ..., version_only: _Optional[bool] = ..., publisher_id: _Optional[str] = ..., mac: _Optional[bytes] = ...) -> None: ...
