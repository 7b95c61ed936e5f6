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
from podrl.weights.protocol import Box


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


# Side streams a single-GPU plan's graph is captured over: hundreds of small copies (norms,
# per-layer slices) then run as parallel graph branches instead of one after the other.
DEFAULT_COPY_STREAMS = 4


def _op_bytes(op: CopyOp) -> int:
    return op.dst.numel() * op.dst.element_size()


def balance_lanes(ops: Sequence[CopyOp], lanes: int) -> list[list[CopyOp]]:
    """Split ``ops`` into ``lanes`` groups of about equal bytes, largest copies first.

    Greedy longest-processing-time: each op (largest first) goes to the lane with the fewest
    bytes so far, so the big copies start at once and the small ones fill in behind them.
    """
    lanes = max(1, lanes)
    groups: list[list[CopyOp]] = [[] for _ in range(lanes)]
    loads = [0] * lanes
    for op in sorted(ops, key=_op_bytes, reverse=True):
        lane = loads.index(min(loads))
        groups[lane].append(op)
        loads[lane] += _op_bytes(op)
    return [group for group in groups if group]


class CopyPlan:
    def __init__(
        self, ops: list[CopyOp], *, use_graph: bool = True, streams: int = DEFAULT_COPY_STREAMS
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be >= 1, not {streams}")
        self.ops = ops
        self.streams = streams
        # One multi-tensor copy per (source device/dtype, destination device/dtype) group:
        # a few kernel launches per sync instead of one per slice.
        groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for op in ops:
            key = (op.src.device, op.src.dtype, op.dst.device, op.dst.dtype)
            dsts, srcs = groups.setdefault(key, ([], []))
            dsts.append(op.dst)
            srcs.append(op.src)
        self._groups = list(groups.items())
        # Every CUDA device a copy touches: a peer copy runs on the source device's stream and
        # the destination's stream waits for it, so completion is awaited on both. (The
        # receiver maps peer sources on the destination device where it can, so a GPU0 -> GPU1
        # plan normally touches GPU1 only and is graph-captured like a same-GPU one.)
        self._cuda_devices = sorted(
            {t.device.index for op in ops for t in (op.src, op.dst) if t.is_cuda}
        )
        # A plan that stays on one GPU is replayed as one CUDA graph: hundreds of copies with
        # one launch (measured on an H200: launch gaps, not bandwidth, set the time of a
        # 1.7B sync), captured over ``streams`` parallel branches.
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_wanted = (
            use_graph
            and len(self._cuda_devices) == 1
            and all(op.src.is_cuda and op.dst.is_cuda for op in ops)
        )

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
        *,
        use_graph: bool = True,
        streams: int = DEFAULT_COPY_STREAMS,
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
        return cls(ops, use_graph=use_graph, streams=streams)

    @property
    def uses_graph(self) -> bool:
        return self._graph is not None

    def _copy_eagerly(self) -> None:
        with torch.no_grad():
            for (src_device, _, dst_device, _), (dsts, srcs) in self._groups:
                if src_device.type == "cpu" and dst_device.type == "cpu":
                    torch._foreach_copy_(dsts, srcs)
                else:
                    # One copy_ per slice: a cudaMemcpy (same dtype) or a vectorised cast
                    # kernel each, near memory bandwidth; torch._foreach_copy_'s multi-tensor
                    # kernel measured 1.3x slower on the 8B shape.
                    for dst, src in zip(dsts, srcs, strict=True):
                        dst.copy_(src, non_blocking=True)

    def launch(self) -> None:
        """Enqueue every copy (slice + cast); on CUDA this returns before the copies finish."""
        if self._graph is not None:
            with torch.cuda.device(self._cuda_devices[0]):
                self._graph.replay()
            return
        self._copy_eagerly()
        if self._graph_wanted:  # the first run was eager; capture it for the next ones
            self._graph_wanted = False
            self._graph = self._capture()

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        """Record the copies as one graph, forked over ``streams`` branches (events inside the
        capture order each side stream after the capture stream and join them back)."""
        lanes = balance_lanes(self.ops, self.streams)
        with torch.cuda.device(self._cuda_devices[0]):
            side = [torch.cuda.Stream() for _ in lanes[1:]]
            # A capture stream of this device: torch's default one is created once per process,
            # on whatever device was current then (a plan on another GPU would capture nothing).
            capture = torch.cuda.Stream()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.no_grad(), torch.cuda.graph(graph, stream=capture):
                    main = torch.cuda.current_stream()
                    for stream in side:
                        stream.wait_stream(main)
                    for lane, stream in zip(lanes, [main, *side], strict=True):
                        with torch.cuda.stream(stream):
                            for op in lane:
                                op.dst.copy_(op.src, non_blocking=True)
                    for stream in side:
                        main.wait_stream(stream)
            except RuntimeError:  # capture unsupported here: stay eager
                return None
        return graph

    def wait(self) -> None:
        """Block until the launched copies are done: an event on each involved device's
        current stream (not a device-wide synchronize, which would also wait for unrelated
        work such as inference running on other streams)."""
        events = []
        for index in self._cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(index))
            events.append(event)
        for event in events:
            event.synchronize()

    def run(self) -> None:
        """Copy every op (slice + cast); on CUDA, returns when the copies are done."""
        self.launch()
        self.wait()
