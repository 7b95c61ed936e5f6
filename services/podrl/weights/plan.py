"""The copy plan: (opened source shards, target layout, destination tensors) -> slice copies.

Compiled once per storage fingerprint. Every op is a pair of tensor *views* — a block of a
source shard mapped from the trainer and the matching block of a destination tensor — so running
the plan for a new version is only ``dst.copy_(src)`` per op (slice, cast and copy in one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from podrl.weights.architectures import TargetLayout
from podrl.weights.codec import Box


@dataclass(frozen=True)
class SourceShard:
    """One opened shard: the block of the global HF tensor it holds and its data."""

    box: Box
    tensor: torch.Tensor


@dataclass(frozen=True)
class CopyOp:
    target: str
    src: torch.Tensor
    dst: torch.Tensor


class CopyPlan:
    def __init__(self, ops: list[CopyOp]) -> None:
        self.ops = ops
        # One multi-tensor copy per (source device/dtype, destination device/dtype) group:
        # a few kernel launches per sync instead of one per slice.
        groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for op in ops:
            key = (op.src.device, op.src.dtype, op.dst.device, op.dst.dtype)
            dsts, srcs = groups.setdefault(key, ([], []))
            dsts.append(op.dst)
            srcs.append(op.src)
        self._groups = list(groups.values())
        self._on_cuda = any(op.dst.is_cuda or op.src.is_cuda for op in ops)

    @property
    def nbytes(self) -> int:
        """Bytes written per run."""
        return sum(op.dst.numel() * op.dst.element_size() for op in self.ops)

    @classmethod
    def compile(
        cls,
        sources: Mapping[str, Sequence[SourceShard]],
        layout: TargetLayout,
        destinations: Mapping[str, torch.Tensor],
    ) -> CopyPlan:
        ops = []
        for target in layout.values():
            dst = destinations[target.name]
            if tuple(dst.shape) != target.shape:
                raise ValueError(
                    f"destination {target.name} has shape {tuple(dst.shape)}, the layout "
                    f"expects {target.shape}"
                )
            origin = (0,) * dst.dim()
            for piece in target.pieces:
                delta = tuple(
                    d - s for d, s in zip(piece.dst_offset, piece.src.offset, strict=True)
                )
                for source in sources[piece.hf_name]:
                    block = source.box.intersect(piece.src)
                    if block is None:
                        continue
                    src_view = source.tensor[block.slices(source.box.offset)]
                    dst_view = dst[block.shifted(delta).slices(origin)]
                    ops.append(CopyOp(target.name, src_view, dst_view))
        return cls(ops)

    def run(self) -> None:
        """Copy every op (slice + cast); on CUDA, returns when the copies are done."""
        with torch.no_grad():
            for dsts, srcs in self._groups:
                torch._foreach_copy_(dsts, srcs)
        if self._on_cuda:
            torch.cuda.synchronize()
