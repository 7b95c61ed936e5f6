"""Conversions between the wire messages of weights.proto and Python/torch values, in one place.

Everything that crosses a process boundary is one of these protobuf messages (never pickle).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from podrl.v1 import weights_pb2

_DEVICE_TYPES = {
    "cpu": weights_pb2.DEVICE_TYPE_CPU,
    "cuda": weights_pb2.DEVICE_TYPE_CUDA,
}


def device_type_to_wire(device_type: str) -> int:
    return _DEVICE_TYPES.get(device_type, weights_pb2.DEVICE_TYPE_UNSPECIFIED)


def mesh_to_wire(device_mesh: object | None) -> weights_pb2.Mesh:
    """A torch DeviceMesh (or None for a plain tensor) as a ``Mesh`` message."""
    if device_mesh is None:
        return weights_pb2.Mesh()
    names = device_mesh.mesh_dim_names or ()
    return weights_pb2.Mesh(
        shape=list(device_mesh.mesh.shape),
        dim_names=list(names),
        device_type=device_type_to_wire(device_mesh.device_type),
    )


def placements_to_wire(placements: Sequence[object]) -> list[weights_pb2.Placement]:
    """DTensor placements (Shard/_StridedShard/Replicate/Partial) as ``Placement`` messages."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for placement in placements:
        if hasattr(placement, "split_factor"):
            # torch's _StridedShard (FSDP2 over a TP-sharded dim); not a Shard subclass.
            out.append(
                weights_pb2.Placement(
                    shard=weights_pb2.ShardPlacement(
                        dim=placement.dim, split_factor=int(placement.split_factor)
                    )
                )
            )
        elif isinstance(placement, Shard):
            out.append(weights_pb2.Placement(shard=weights_pb2.ShardPlacement(dim=placement.dim)))
        elif isinstance(placement, Replicate):
            out.append(weights_pb2.Placement(replicate=weights_pb2.ReplicatePlacement()))
        elif isinstance(placement, Partial):
            out.append(
                weights_pb2.Placement(
                    partial=weights_pb2.PartialPlacement(reduce_op=str(placement.reduce_op))
                )
            )
        else:
            raise ValueError(f"placement {placement!r} has no wire form")
    return out


@dataclass(frozen=True)
class Box:
    """An axis-aligned block of a tensor: ``offset`` and ``shape`` per dimension."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    def intersect(self, other: Box) -> Box | None:
        offset, shape = [], []
        for a0, an, b0, bn in zip(self.offset, self.shape, other.offset, other.shape, strict=True):
            lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
            if hi <= lo:
                return None
            offset.append(lo)
            shape.append(hi - lo)
        return Box(tuple(offset), tuple(shape))

    def slices(self, origin: Sequence[int]) -> tuple[slice, ...]:
        """Index of this box inside a tensor whose element [0, ...] sits at ``origin``."""
        return tuple(
            slice(o - base, o - base + n)
            for o, n, base in zip(self.offset, self.shape, origin, strict=True)
        )

    def shifted(self, delta: Sequence[int]) -> Box:
        return Box(tuple(o + d for o, d in zip(self.offset, delta, strict=True)), self.shape)


def shard_box(shard: weights_pb2.TensorShard) -> Box:
    """The block of the global tensor a shard holds."""
    return Box(tuple(shard.local_offset), tuple(shard.local_shape))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def placement_label(placement: weights_pb2.Placement) -> str:
    kind = placement.WhichOneof("kind")
    if kind == "shard":
        return f"Shard({placement.shard.dim})"
    if kind == "partial":
        return f"Partial({placement.partial.reduce_op})"
    return "Replicate()" if kind == "replicate" else "unset"
