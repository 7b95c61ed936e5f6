"""Collect every trainer rank's publication on one rank as protobuf bytes (no pickle).

``torch.distributed.gather_object`` would pickle; instead each rank serializes its
:class:`RankPublication` (a ``WeightManifest`` message) and the bytes travel as uint8 tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from podrl.weights.protocol import RankPublication


def gather_bytes(
    payload: bytes, dst: int = 0, group: dist.ProcessGroup | None = None
) -> list[bytes]:
    """Every rank's ``payload`` on rank ``dst`` (in rank order); other ranks get ``[]``.

    Uses the group's backend device (CPU for gloo, the current CUDA device for nccl).
    """
    world = dist.get_world_size(group)
    if world == 1:  # this rank is ``dst``: nothing to exchange
        return [payload]
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
    rank = dist.get_rank(group)
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = int(max(s.item() for s in sizes))
    # Never a zero-size buffer: some backends refuse to gather empty tensors.
    data = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    if payload:
        data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    global_dst = dst if group is None else dist.get_global_rank(group, dst)
    received = [torch.zeros_like(data) for _ in range(world)] if rank == dst else None
    dist.gather(data, received, dst=global_dst, group=group)
    if received is None:
        return []
    return [
        bytes(t[: int(s.item())].cpu().numpy().tobytes())
        for t, s in zip(received, sizes, strict=True)
    ]


def gather_publications(
    publication: RankPublication, dst: int = 0, group: dist.ProcessGroup | None = None
) -> list[RankPublication]:
    """Every rank's publication on rank ``dst``; ``[]`` elsewhere."""
    return [RankPublication.from_bytes(b) for b in gather_bytes(publication.to_bytes(), dst, group)]
