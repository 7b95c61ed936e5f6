"""The one mapping between torch dtypes and the wire ``DType`` enum of weights.proto."""

from __future__ import annotations

import torch

from podrl.v1 import weights_pb2

_TORCH_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: weights_pb2.DTYPE_FLOAT32,
    torch.bfloat16: weights_pb2.DTYPE_BFLOAT16,
    torch.float16: weights_pb2.DTYPE_FLOAT16,
    torch.float64: weights_pb2.DTYPE_FLOAT64,
    torch.int64: weights_pb2.DTYPE_INT64,
    torch.int32: weights_pb2.DTYPE_INT32,
    torch.int16: weights_pb2.DTYPE_INT16,
    torch.int8: weights_pb2.DTYPE_INT8,
    torch.uint8: weights_pb2.DTYPE_UINT8,
    torch.bool: weights_pb2.DTYPE_BOOL,
    torch.float8_e4m3fn: weights_pb2.DTYPE_FLOAT8_E4M3FN,
    torch.float8_e5m2: weights_pb2.DTYPE_FLOAT8_E5M2,
}
_WIRE_TO_TORCH: dict[int, torch.dtype] = {v: k for k, v in _TORCH_TO_WIRE.items()}

# Weights a receiver may cast into its own floating dtype (fp8 needs scales: not castable).
CASTABLE_FLOAT_DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16, torch.float64})

_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
}


def to_wire(dtype: torch.dtype) -> int:
    """torch dtype -> ``weights_pb2.DType`` value; ValueError for a dtype the protocol lacks."""
    try:
        return _TORCH_TO_WIRE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no DType in weights.proto") from None


def from_wire(value: int) -> torch.dtype | None:
    """``weights_pb2.DType`` value -> torch dtype, or None for UNSPECIFIED/unknown values."""
    return _WIRE_TO_TORCH.get(value)


def wire_name(value: int) -> str:
    """Readable name of a wire dtype for error messages (e.g. ``DTYPE_BFLOAT16``)."""
    try:
        return weights_pb2.DType.Name(value)
    except ValueError:
        return f"DType({value})"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``"float32"``/torch dtype -> torch dtype (config strings)."""
    if isinstance(name, torch.dtype):
        return name
    key = name.removeprefix("torch.").lower()
    try:
        return _NAMES[key]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_NAMES)}") from None


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
