"""Describe a module's (sharded) parameters as ``TensorShard`` entries, and fingerprint them.

Works on plain tensors and on DTensors from FSDP2 (``fully_shard``) and tensor parallelism
(``parallelize_module``) alike: each rank describes only its own local shard, with the box it
holds in the global tensor computed by torch's ``compute_local_shape_and_global_offset``.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

import podrl.weights.codec as codec
import podrl.weights.dtypes as dtypes
from podrl.v1 import weights_pb2


@dataclass
class LocalShard:
    """One parameter's local shard on this rank, before a storage handle is attached."""

    name: str
    tensor: torch.Tensor  # the local data (a view of the parameter's storage)
    global_shape: tuple[int, ...]
    local_offset: tuple[int, ...]
    mesh: weights_pb2.Mesh
    mesh_coordinate: tuple[int, ...]
    placements: list[weights_pb2.Placement]

    def to_wire(self, storage: weights_pb2.TensorStorage, rank: int) -> weights_pb2.TensorShard:
        return weights_pb2.TensorShard(
            name=self.name,
            dtype=dtypes.to_wire(self.tensor.dtype),
            global_shape=list(self.global_shape),
            local_shape=list(self.tensor.shape),
            local_offset=list(self.local_offset),
            stride=list(self.tensor.stride()),
            mesh=self.mesh,
            mesh_coordinate=list(self.mesh_coordinate),
            placements=self.placements,
            storage=storage,
            publisher_rank=rank,
        )


def local_shards(params: Mapping[str, torch.Tensor]) -> list[LocalShard]:
    """One ``LocalShard`` per parameter (DTensor or plain), in the mapping's order.

    A rank outside a parameter's mesh, or one holding an empty shard, contributes nothing.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out = []
    for name, param in params.items():
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            mesh = tensor.device_mesh
            coordinate = mesh.get_coordinate()
            if coordinate is None:
                continue
            local = tensor.to_local()
            local_shape, offset = compute_local_shape_and_global_offset(
                tensor.shape, mesh, tensor.placements
            )
            if tuple(local.shape) != tuple(local_shape):
                raise RuntimeError(
                    f"{name}: local tensor {tuple(local.shape)} differs from the DTensor layout "
                    f"{tuple(local_shape)}; cannot describe this shard"
                )
            if local.numel() == 0:
                continue
            out.append(
                LocalShard(
                    name=name,
                    tensor=local,
                    global_shape=tuple(tensor.shape),
                    local_offset=tuple(offset),
                    mesh=codec.mesh_to_wire(mesh),
                    mesh_coordinate=tuple(coordinate),
                    placements=codec.placements_to_wire(tensor.placements),
                )
            )
        else:
            out.append(
                LocalShard(
                    name=name,
                    tensor=tensor,
                    global_shape=tuple(tensor.shape),
                    local_offset=(0,) * tensor.dim(),
                    mesh=weights_pb2.Mesh(
                        device_type=codec.device_type_to_wire(tensor.device.type)
                    ),
                    mesh_coordinate=(),
                    placements=[],
                )
            )
    return out


def storage_key(params: Mapping[str, torch.Tensor]) -> tuple:
    """A cheap value that changes with the storage behind ``params`` (compared each publish;
    :func:`storage_fingerprint` is computed only when it changed)."""
    from torch.distributed.tensor import DTensor

    key = []
    for name, param in params.items():
        local = param.to_local() if isinstance(param, DTensor) else param
        key.append((name, local.data_ptr(), local.dtype, tuple(local.shape), local.stride()))
    return tuple(key)


def storage_fingerprint(shards: Iterable[LocalShard]) -> str:
    """A hash that changes whenever the published storage changes.

    It covers every shard's name, dtype, shapes, offset, stride and placements *and* where its
    data lives (device, data pointer) plus this process's identity, so re-sharding, resizing,
    re-allocating (e.g. loading a checkpoint into new tensors) or restarting the trainer all
    give a new fingerprint, which forces a full manifest.
    """
    digest = hashlib.sha256()
    digest.update(f"pid={os.getpid()};".encode())
    for shard in shards:
        t = shard.tensor
        digest.update(
            (
                f"{shard.name}|{t.dtype}|{shard.global_shape}|{tuple(t.shape)}|"
                f"{shard.local_offset}|{t.stride()}|{t.device}|{t.data_ptr()}|"
                f"{shard.mesh_coordinate}|"
                f"{[codec.placement_label(p) for p in shard.placements]};"
            ).encode()
        )
    return digest.hexdigest()


def combine_fingerprints(rank_fingerprints: Iterable[str]) -> str:
    """The model fingerprint of a multi-rank publication (rank order matters)."""
    digest = hashlib.sha256()
    for fingerprint in rank_fingerprints:
        digest.update(fingerprint.encode())
        digest.update(b";")
    return digest.hexdigest()
