"""The weight-transfer protocol both sides share: the interfaces, what a manifest says and how
it travels, the storage it names, and its MAC.

* the two sides' interfaces, :class:`Publisher` and :class:`Receiver` (below), and what they
  hand on (:class:`RankPublication`, :class:`CopiedWeights`);
* the wire: conversions between ``weights.proto``'s messages and torch values (meshes,
  placements, boxes, dtypes), never pickle;
* describing a module's (sharded) parameters as ``TensorShard`` entries, and their storage
  fingerprint;
* the finiteness check both sides run (the trainer before it publishes, the receiver before it
  copies);
* the storage a handle names on CPU: named POSIX shared-memory segments, their creation,
  read-only opening and reaping (CUDA IPC handles: ``podrl.weights.cuda_ipc``);
* the pod's weights key: the MAC the trainer signs every manifest with and the generator checks.

The two sides of a weight update, with vLLM's phase names (docs/weights.md, "Lifecycle").

vLLM's weight-transfer engines (``vllm.distributed.weight_transfer.base``) run an update as
``start_weight_update`` → ``update_weights`` → ``finish_weight_update`` and release their
resources in ``shutdown``. podrl's two sides follow the same lifecycle:

* **start**. Publisher: make ``version`` readable and describe this rank's shards; ``version``
  is pending. Receiver: validate the manifest, plan the copy, open every storage handle, check
  that the weights are finite.
* **update**. Publisher (rank 0): merge the ranks' parts into one signed manifest. Receiver:
  copy into the destinations.
* **finish**. Publisher: the generators applied ``version``, the storage may change again.
  Receiver: every copy is done and the trainer's storage is no longer read; the filled tensors.
* **close**. Publisher: unlink what it published. Receiver: drop the opened handles and buffers.

What a failure leaves, side by side:

* ``Publisher.start`` refuses (:class:`~podrl.weights.errors.PublishError`: the previous version
  is not finished, or the weights hold NaN or infinity): nothing becomes pending, what was
  published stays published.
* ``Receiver.start`` refuses (:class:`~podrl.weights.errors.ManifestError`): nothing was written;
  the receiver and the destinations are as they were, so the served version stays.
* ``Receiver.update`` fails part-way: the destinations are partly written (the generator serves
  no known version until a full manifest: ``podrl.generator.worker_extension``'s ``needs_full``);
  the plan stays cached, so a later update of the same storage rewrites every destination.

The wire between the two sides is a ``podrl.v1.WeightManifest`` (protobuf, MAC-signed;
the weights key, below). The shared-memory staging copy (CPU) and the CUDA IPC export of the
live parameters (GPU) both sit behind :class:`Publisher`; a :class:`Receiver` opens either kind
of storage handle.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from podrl.config import ConfigError
from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind


@dataclass
class RankPublication:
    """What one rank contributes to a manifest: its storage fingerprint and its shards."""

    rank: int
    fingerprint: str
    shards: list[weights_pb2.TensorShard]

    def to_bytes(self) -> bytes:
        """Serialized as a ``WeightManifest`` message (protobuf, never pickle)."""
        message = weights_pb2.WeightManifest(
            model_fingerprint=self.fingerprint, shards=self.shards, publisher_id=str(self.rank)
        )
        return message.SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> RankPublication:
        message = weights_pb2.WeightManifest.FromString(data)
        return cls(
            rank=int(message.publisher_id),
            fingerprint=message.model_fingerprint,
            shards=list(message.shards),
        )


@dataclass
class CopiedWeights:
    """Result of one update: iterate it for (name, tensor) pairs in the layout's naming."""

    version: int
    """The manifest's version (what the tensors now hold)."""
    plan_cached: bool
    seconds: float
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


class Publisher(ABC):
    """Trainer side: one per trainer rank; the phases are in the module docstring.

    A rank of several calls :meth:`start` on every rank, gathers the parts to rank 0 (podrl's
    ``podrl.weights.distributed``), and rank 0 calls :meth:`update` and answers with the
    manifest. :meth:`finish` runs on every rank when the generators acknowledge.
    """

    @abstractmethod
    def start(
        self, version: int, *, ack_timeout: float = 0.0, check_finite: bool = True
    ) -> RankPublication:
        """Make ``version`` readable and describe this rank's shards; ``version`` is pending.

        Waits up to ``ack_timeout`` seconds for the previous version's :meth:`finish` and
        raises :class:`~podrl.weights.errors.PublishError` if it does not come (starting the
        pending version again is allowed, e.g. a full manifest for a new generator). Raises
        ``PublishError`` naming a parameter that holds NaN or infinity (``check_finite``; a
        caller that checked every rank already passes False). On either refusal nothing
        becomes pending.
        """

    @abstractmethod
    def update(
        self, version: int, parts: Sequence[RankPublication], *, force_full: bool = False
    ) -> weights_pb2.WeightManifest:
        """Rank 0: merge every rank's part into one signed manifest, full when the storage
        changed since the last one (or ``force_full``), else version-only."""

    @abstractmethod
    def finish(self, version: int) -> None:
        """The generators applied ``version``: the storage may change again."""

    @abstractmethod
    def close(self) -> None:
        """Release what was published (shared-memory segments are unlinked)."""

    @property
    @abstractmethod
    def pending_version(self) -> int | None:
        """The version started and not finished yet, if any."""

    @property
    @abstractmethod
    def must_wait_before_step(self) -> bool:
        """True while the optimizer may not touch the parameters (the generators read the live
        parameters, and a version is pending)."""

    @abstractmethod
    def wait_for_acknowledgement(self, timeout: float | None = None) -> bool:
        """Block until no version is pending; False on timeout."""

    @abstractmethod
    def non_finite_parameter(self) -> str | None:
        """The name of a parameter of this rank holding NaN or infinity, or None."""


class Receiver(ABC):
    """Generator side: one per model replica (one generator worker); the phases are in the
    module docstring. :meth:`apply` runs the three for a caller with nothing to do between."""

    @abstractmethod
    def start(
        self,
        manifest: weights_pb2.WeightManifest,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Check ``manifest`` and get every source ready to copy into ``destinations`` (name ->
        tensor in the layout's naming; without them, buffers the receiver owns). Raises
        :class:`~podrl.weights.errors.ManifestError` with nothing written."""

    @abstractmethod
    def update(self) -> None:
        """Copy the started manifest's weights; returns when every copy has finished."""

    @abstractmethod
    def finish(self) -> CopiedWeights:
        """End the update: the trainer's storage is no longer read; the filled tensors."""

    @abstractmethod
    def close(self) -> None:
        """Drop the opened handles and the buffers."""

    def apply(
        self,
        manifest: weights_pb2.WeightManifest,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> CopiedWeights:
        """start → update → finish."""
        self.start(manifest, destinations)
        self.update()
        return self.finish()


# -- wire conversions ------------------------------------------------------------------------------
#
# Conversions between the wire messages of weights.proto and Python/torch values, in one place.
#
# Everything that crosses a process boundary is one of these protobuf messages (never pickle).


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


# -- dtypes on the wire ----------------------------------------------------------------------------
#
# The one mapping between torch dtypes and the wire ``DType`` enum of weights.proto.


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


# -- describing shards -----------------------------------------------------------------------------
#
# Describe a module's (sharded) parameters as ``TensorShard`` entries, and fingerprint them.
#
# Works on plain tensors and on DTensors from FSDP2 (``fully_shard``) and tensor parallelism
# (``parallelize_module``) alike: each rank describes only its own local shard, with the box it
# holds in the global tensor computed by torch's ``compute_local_shape_and_global_offset``.


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
            dtype=to_wire(self.tensor.dtype),
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
                    mesh=mesh_to_wire(mesh),
                    mesh_coordinate=tuple(coordinate),
                    placements=placements_to_wire(tensor.placements),
                )
            )
        else:
            out.append(
                LocalShard(
                    name=name,
                    tensor=tensor,
                    global_shape=tuple(tensor.shape),
                    local_offset=(0,) * tensor.dim(),
                    mesh=weights_pb2.Mesh(device_type=device_type_to_wire(tensor.device.type)),
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
                f"{[placement_label(p) for p in shard.placements]};"
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


# -- the finiteness check --------------------------------------------------------------------------
#
# One cheap check that a set of tensors holds no NaN and no infinity.
#
# Per (device, dtype) group, one multi-tensor L2 norm (``torch._foreach_norm``): a sum of squares
# propagates NaN and infinity and cannot cancel them, so a finite result means every element is
# finite. Only when a group's result is not finite are its tensors looked at one by one, to name
# one; finite values so large that their squares overflow are found finite there. On CPU the L2
# norm is about ten times faster than the max-magnitude (``inf``) norm or ``isfinite`` over the
# same tensors (0.2 against 2.0 ms for the tiny model's 25 parameters). The trainer runs it before
# it publishes, the generator's receiver before it copies.
#
# :class:`FiniteCheck` is the same check over tensors that stay the same objects between calls
# (the receiver's mapped sources, whose values change with every version): on one CUDA device it
# is recorded once as a CUDA graph, so a call is one graph launch and one host sync instead of a
# Python pass and a launch per 8-16 tensors (on an H200 for the 0.6B shape, 310 tensors: 2.7 ms
# per call eagerly, of which 0.7 ms on the GPU; bench/apply_anatomy.py).


def _floating_groups(
    named: Iterable[tuple[str, torch.Tensor]],
) -> dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]]:
    """The non-empty floating-point tensors of ``named``, by (device, dtype)."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        if tensor.numel() and (tensor.is_floating_point() or tensor.is_complex()):
            groups.setdefault((tensor.device, tensor.dtype), []).append((name, tensor))
    return groups


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of a tensor holding NaN or infinity, or None when every element is finite."""
    for group in _floating_groups(named).values():
        with torch.no_grad():
            norms = torch.stack(torch._foreach_norm([t for _, t in group], 2.0))
            if bool(torch.isfinite(norms.float().sum())):
                continue
            bad = next((name for name, t in group if not bool(torch.isfinite(t).all())), None)
            if bad is not None:
                return bad
    return None


class FiniteCheck:
    """:func:`first_non_finite` over a fixed list of tensors, prepared once.

    The tensors must stay the same objects (same storage) for the check's life; their values
    may change between calls. When they all lie on one CUDA device, the first call (eager)
    also records the reduction as a CUDA graph, and later calls replay it; a verdict of "not
    finite" is confirmed and named by :func:`first_non_finite` itself.
    """

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]], *, use_graph: bool = True):
        groups = _floating_groups(named)
        self._named = [pair for group in groups.values() for pair in group]
        devices = {device for device, _ in groups}
        self._graph_wanted = use_graph and len(devices) == 1 and next(iter(devices)).type == "cuda"
        self._graph: torch.cuda.CUDAGraph | None = None
        self._verdict: torch.Tensor | None = None

    @property
    def uses_graph(self) -> bool:
        return self._graph is not None

    def first_non_finite(self) -> str | None:
        """The name of a tensor holding NaN or infinity, or None when every element is finite."""
        if self._graph is None:
            bad = first_non_finite(self._named)
            if self._graph_wanted:  # the first call was eager: record it for the next ones
                self._graph_wanted = False
                self._capture()
            return bad
        self._graph.replay()
        return None if bool(self._verdict) else first_non_finite(self._named)

    def _capture(self) -> None:
        """Record one 0-d bool tensor, True when every group's L2 norm (hence every element)
        is finite."""
        groups = [[t for _, t in group] for group in _floating_groups(self._named).values()]
        device = groups[0][0].device
        with torch.cuda.device(device), torch.no_grad():
            # A capture stream of this device (torch's default side stream belongs to whatever
            # device was current when it was first made).
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, stream=stream):
                    total = torch.zeros((), dtype=torch.float32, device=device)
                    for tensors in groups:
                        norms = torch.stack(torch._foreach_norm(tensors, 2.0))
                        total = total + norms.float().sum()
                    verdict = torch.isfinite(total)
            except RuntimeError:  # capture unsupported here: stay eager
                return
            torch.cuda.current_stream().wait_stream(stream)
        self._graph, self._verdict = graph, verdict


# -- shared-memory segments ------------------------------------------------------------------------
#
# Named POSIX shared-memory segments for CPU weights, and the reaper of orphaned ones.
#
# A segment is ``/dev/shm/<name>`` (what ``shm_open`` uses on Linux) with the name
# ``podrl-w-<creator pid>-<creator start time>-<random>``. The creator unlinks its segments when
# it closes them or exits (atexit, SIGTERM through the service's normal shutdown). A creator killed
# with ``kill -9`` cannot, so both sides call :func:`reap_orphaned_segments` when they start and
# when they close: it unlinks every podrl segment whose creator (pid *and* start time, so a reused
# pid does not keep garbage alive) no longer runs. That needs one PID namespace for trainer and
# generator, which the pod has anyway (``shareProcessNamespace: true``; CUDA IPC needs it too).
#
# Where ``/proc/<pid>/stat`` cannot be read, the start time is unknown, never guessed: the
# creator writes ``unknown`` in the name, and a reader that cannot read a creator's start time
# goes by the pid alone. Such a segment counts as alive while its pid runs (a reused pid may
# then keep it until that process ends); it is never reaped or refused on a guess.
#
# Readers map segments read-only, so a generator can never write into the trainer's memory, and
# open them only as regular files (no symlink is followed) of the trainer's user with exactly the
# size the manifest declares.


SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "podrl-w-"
UNKNOWN_START = "unknown"
_NAME_RE = re.compile(rf"^podrl-w-(\d+)-(\d+|{UNKNOWN_START})-[0-9a-f]+$")
PROC_DIR = Path("/proc")
# Tensors inside a segment start at multiples of this (cache line; any dtype is aligned).
ALIGNMENT = 64


def _process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat); None
    when it cannot be read (process gone, /proc missing or restricted)."""
    try:
        stat = (PROC_DIR / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def _pid_running(pid: int) -> bool:
    """Whether a process ``pid`` exists in this PID namespace (no /proc needed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def segment_name(pid: int | None = None) -> str:
    """A fresh segment name owned by ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    start = _process_start_time(pid)
    start_field = UNKNOWN_START if start is None else str(start)
    return f"{SEGMENT_PREFIX}{pid}-{start_field}-{secrets.token_hex(6)}"


def segment_creator(name: str) -> tuple[int, int | None] | None:
    """(pid, start time or None where the creator could not read it) encoded in a podrl
    segment name, or None for other names."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    start = match.group(2)
    return int(match.group(1)), None if start == UNKNOWN_START else int(start)


def creator_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` still runs: same pid and start time;
    by the pid alone where either start time is unknown."""
    creator = segment_creator(name)
    if creator is None:
        return False
    pid, start = creator
    if not _pid_running(pid):
        return False
    running_start = _process_start_time(pid)
    if start is None or running_start is None:
        return True
    return running_start == start


def reap_orphaned_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink podrl segments whose creator process is gone; returns the names removed."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if segment_creator(name) is None or creator_alive(name):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_dir / name)
            removed.append(name)
    return removed


def list_segments(pid: int | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """podrl segment names present now (of one creator pid if given)."""
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        creator = segment_creator(name)
        if creator is not None and (pid is None or creator[0] == pid):
            out.append(name)
    return sorted(out)


class SharedSegment:
    """One segment this process created: a writable byte tensor over it, unlinked on close."""

    def __init__(self, nbytes: int, shm_dir: Path = SHM_DIR) -> None:
        self.name = segment_name()
        self.nbytes = max(int(nbytes), 1)
        self._path = shm_dir / self.name
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._mmap = mmap.mmap(
                fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self.data = torch.frombuffer(self._mmap, dtype=torch.uint8)
        _register(self)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of ``dtype``/``shape`` at byte ``offset`` of the segment."""
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + nbytes].view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the name (readers that mapped it keep their mapping until they close it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        _unregister(self)


class UnsafeSegmentError(OSError):
    """A file under a podrl segment name that is not what the trainer creates: not a regular
    file, another user's, or not of the declared size."""


_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def open_segment_readonly(
    name: str,
    shm_dir: Path = SHM_DIR,
    *,
    nbytes: int | None = None,
    owner_uid: int | None = None,
) -> torch.Tensor:
    """Map an existing segment read-only as a uint8 tensor (FileNotFoundError if it is gone).

    Opened without following symlinks (and without blocking on a FIFO); the file must be a
    regular file owned by ``owner_uid`` (default: this process's user) and, when ``nbytes``
    is given, exactly that large; anything else raises :class:`UnsafeSegmentError` (or the
    open's own OSError, e.g. ELOOP for a symlink). The mapping lives as long as the returned
    tensor (and its views) does.
    """
    if segment_creator(name) is None or "/" in name:
        raise FileNotFoundError(f"not a podrl shared-memory segment name: {name!r}")
    fd = os.open(shm_dir / name, _OPEN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeSegmentError(f"{name} is not a regular file")
        expected_owner = os.geteuid() if owner_uid is None else owner_uid
        if info.st_uid != expected_owner:
            raise UnsafeSegmentError(
                f"{name} belongs to uid {info.st_uid}, not to the trainer's user {expected_owner}"
            )
        size = info.st_size
        if nbytes is not None and size != nbytes:
            raise UnsafeSegmentError(f"{name} holds {size} bytes, the manifest declares {nbytes}")
        if size == 0:
            raise UnsafeSegmentError(f"{name} is empty")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point (read-only mapping).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


_LIVE: dict[str, SharedSegment] = {}
_LIVE_LOCK = threading.Lock()


def _register(segment: SharedSegment) -> None:
    with _LIVE_LOCK:
        _LIVE[segment.name] = segment


def _unregister(segment: SharedSegment) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(segment.name, None)


@atexit.register
def unlink_all_segments() -> None:
    """Unlink every segment this process still owns (runs at interpreter exit)."""
    with _LIVE_LOCK:
        # A forked child inherits this registry and atexit hook; only the creator unlinks.
        segments = [s for s in _LIVE.values() if segment_creator(s.name)[0] == os.getpid()]
    for segment in segments:
        segment.unlink()


# -- the weights key -------------------------------------------------------------------------------
#
# The pod's weights key: only the pod's own trainer can hand its generator a manifest.
#
# A ``WeightManifest`` names shared-memory segments and CUDA allocations that the generator then
# reads as its policy, so a forged one poisons generation. Every manifest the trainer assembles
# carries ``mac``: HMAC-SHA256, keyed by the pod's **weights key**, over the manifest's
# deterministic protobuf encoding with ``mac`` left empty (prefixed with a purpose string, so the
# key signs nothing else). The generator checks it before anything else, constant-time, and
# refuses a missing or wrong one (``ManifestErrorKind.UNAUTHENTIC`` → ``PERMISSION_DENIED``).
#
# The key is 32 random bytes, hex-encoded in a file whose path is ``PODRL_WEIGHTS_KEY_FILE``.
# Only the pod's trainer and generator get that variable (and the file):
#
# * ``podrl up``/``podrl run`` write a fresh key for the pod at every start
#   (:func:`write_fresh_key_file`, mode 0600) and pass its path to the trainer and the generator;
# * on Kubernetes the chart mounts a memory-backed ``emptyDir`` in those two containers only; the
#   trainer creates the key there when it starts (:func:`load_trainer_key`: created once with
#   ``O_EXCL``, read by every later start of the pod's trainer), the generator reads it when the
#   first manifest arrives (the trainer made it before it could publish one, so nobody waits).
#
# A key file is opened without following symlinks and must be a regular file that grants nothing
# to group or others, owned by the reading user (a generator running as root accepts the owner
# the pod gave it). Its owner is also the user whose shared-memory segments the generator opens
# (shared-memory segments, above): the trainer's.
#
# Without ``PODRL_WEIGHTS_KEY_FILE`` a trainer publishes manifests without a MAC (and says so at
# start), and a generator refuses every manifest: weights cannot move until both have the key.
# The MAC proves where a manifest comes from, not that it is new: re-sending an old manifest of
# the pod's own trainer is stopped by the weight state (a version not newer is refused, a rollback
# must go to an older version) and by the run secret (only the controller may call ApplyWeights).


log = logging.getLogger(__name__)

WEIGHTS_KEY_FILE_ENV = "PODRL_WEIGHTS_KEY_FILE"
"""Environment variable naming the pod's weights key file (not a run-config override)."""
KEY_BYTES = 32
_MAX_FILE_BYTES = 4096
_MAC_PURPOSE = b"podrl.v1.WeightManifest mac v1\0"


class WeightsKeyError(ConfigError):
    """The weights key file is missing, unsafe or malformed; the message names
    ``PODRL_WEIGHTS_KEY_FILE`` and the fix (a ConfigError: a service exits 2 with it)."""


def manifest_mac(secret: bytes, manifest: weights_pb2.WeightManifest) -> bytes:
    """HMAC-SHA256 of ``manifest`` with its ``mac`` field empty (deterministic encoding)."""
    unsigned = weights_pb2.WeightManifest()
    unsigned.CopyFrom(manifest)
    unsigned.ClearField("mac")
    payload = unsigned.SerializeToString(deterministic=True)
    return hmac.new(secret, _MAC_PURPOSE + payload, hashlib.sha256).digest()


@dataclass(frozen=True)
class WeightsKey:
    """The pod's weights key and the user that owns its file (the trainer's user)."""

    secret: bytes
    owner_uid: int

    def __repr__(self) -> str:  # never print the secret
        return f"WeightsKey(owner_uid={self.owner_uid})"

    def sign(self, manifest: weights_pb2.WeightManifest) -> None:
        """Set ``manifest.mac`` (after every other field is final)."""
        manifest.mac = manifest_mac(self.secret, manifest)

    def verify(self, manifest: weights_pb2.WeightManifest) -> None:
        """Raise ``ManifestError(UNAUTHENTIC)`` unless ``manifest.mac`` is this key's MAC."""
        if not manifest.mac:
            raise ManifestError(
                ManifestErrorKind.UNAUTHENTIC,
                "the manifest carries no mac; only the pod's own trainer (holding the pod's "
                f"weights key, {WEIGHTS_KEY_FILE_ENV}) can publish weights to this generator",
            )
        if not hmac.compare_digest(manifest.mac, manifest_mac(self.secret, manifest)):
            raise ManifestError(
                ManifestErrorKind.UNAUTHENTIC,
                "the manifest's mac does not match the pod's weights key: it was not "
                "published by this pod's trainer, or was changed after it was signed",
            )


def _parse(text: bytes, path: Path) -> bytes:
    try:
        secret = bytes.fromhex(text.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        raise WeightsKeyError(
            f"{WEIGHTS_KEY_FILE_ENV}: {path} does not hold a hex-encoded key; delete it (the "
            "trainer writes a new one) or write `openssl rand -hex 32` into it"
        ) from None
    if len(secret) < KEY_BYTES:
        raise WeightsKeyError(
            f"{WEIGHTS_KEY_FILE_ENV}: {path} holds {len(secret)} bytes, at least {KEY_BYTES} "
            "are needed (`openssl rand -hex 32`)"
        )
    return secret


def read_key_file(path: Path) -> WeightsKey:
    """The key in ``path``; raises FileNotFoundError if there is none yet, WeightsKeyError if
    the file is unsafe (a symlink, not a regular file, readable by group or others, owned by
    another user) or malformed."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise WeightsKeyError(
            f"{WEIGHTS_KEY_FILE_ENV}: cannot open {path} ({err.strerror}); it must be a "
            "regular file of this user (symlinks are not followed)"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise WeightsKeyError(f"{WEIGHTS_KEY_FILE_ENV}: {path} is not a regular file")
        if info.st_mode & 0o077:
            raise WeightsKeyError(
                f"{WEIGHTS_KEY_FILE_ENV}: {path} has mode {stat.S_IMODE(info.st_mode):o}; it "
                "must grant nothing to group or others (chmod 600)"
            )
        euid = os.geteuid()
        if euid != 0 and info.st_uid != euid:
            raise WeightsKeyError(
                f"{WEIGHTS_KEY_FILE_ENV}: {path} belongs to uid {info.st_uid}, not to this "
                f"service's user {euid}"
            )
        text = os.read(fd, _MAX_FILE_BYTES)
    finally:
        os.close(fd)
    return WeightsKey(_parse(text, path), info.st_uid)


def _write_new(path: Path) -> Path:
    """A new sibling of ``path`` with a fresh key, mode 0600 from its creation on."""
    fresh = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, (secrets.token_hex(KEY_BYTES) + "\n").encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        fresh.unlink(missing_ok=True)
        raise
    os.close(fd)
    return fresh


def write_fresh_key_file(path: Path) -> WeightsKey:
    """Replace ``path`` with a new random key (``podrl up``: a new key at every start). The
    file is complete before its name appears: no reader sees it half written."""
    path = Path(path)
    fresh = _write_new(path)
    os.replace(fresh, path)
    return read_key_file(path)


def create_key_file(path: Path) -> WeightsKey:
    """The key in ``path``, written first if there is none (exactly once however many
    processes race: a complete file is linked into place, which fails if the name exists)."""
    path = Path(path)
    with contextlib.suppress(FileNotFoundError):
        return read_key_file(path)
    fresh = _write_new(path)
    try:
        os.link(fresh, path)
    except FileExistsError:
        pass  # another process was first: use its key
    finally:
        fresh.unlink(missing_ok=True)
    return read_key_file(path)


def key_file_path(env: Mapping[str, str] | None = None) -> Path | None:
    value = (os.environ if env is None else env).get(WEIGHTS_KEY_FILE_ENV, "")
    return Path(value) if value else None


def load_trainer_key(env: Mapping[str, str] | None = None) -> WeightsKey | None:
    """The trainer's key (created if the file does not exist yet); None, with a warning, when
    ``PODRL_WEIGHTS_KEY_FILE`` is unset (manifests then carry no MAC and no generator takes
    them)."""
    path = key_file_path(env)
    if path is None:
        log.warning(
            "%s is not set: weight manifests are published without a mac, and generators "
            "refuse them",
            WEIGHTS_KEY_FILE_ENV,
        )
        return None
    try:
        return create_key_file(path)
    except OSError as err:
        raise WeightsKeyError(
            f"{WEIGHTS_KEY_FILE_ENV}: cannot create {path} ({err.strerror}); point it into a "
            "writable folder that only the pod's trainer and generator see"
        ) from None


class GeneratorKey:
    """The generator's view of the pod's key: read when the first manifest needs it (the
    trainer creates the file at its start, before it can publish), then kept."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.path = key_file_path(env)
        self._key: WeightsKey | None = None
        self._lock = threading.Lock()
        if self.path is None:
            log.warning(
                "%s is not set: this generator refuses every weight manifest (PERMISSION_DENIED)",
                WEIGHTS_KEY_FILE_ENV,
            )

    def get(self) -> WeightsKey:
        """The key; ``ManifestError(UNAUTHENTIC)`` if there is none (nothing can be verified)."""
        with self._lock:
            if self._key is not None:
                return self._key
            if self.path is None:
                raise ManifestError(
                    ManifestErrorKind.UNAUTHENTIC,
                    f"this generator has no weights key ({WEIGHTS_KEY_FILE_ENV} is not set), so "
                    "it cannot verify any manifest; give it and its pod's trainer the same key "
                    "file",
                )
            try:
                self._key = read_key_file(self.path)
            except FileNotFoundError:
                raise ManifestError(
                    ManifestErrorKind.UNAUTHENTIC,
                    f"no weights key at {self.path} ({WEIGHTS_KEY_FILE_ENV}) yet: the pod's "
                    "trainer writes it when it starts",
                ) from None
            except WeightsKeyError as err:
                raise ManifestError(ManifestErrorKind.UNAUTHENTIC, str(err)) from None
            return self._key

    def verify(self, manifest: weights_pb2.WeightManifest) -> WeightsKey:
        """Raise ``ManifestError(UNAUTHENTIC)`` unless ``manifest`` is signed by the pod's
        key; returns the key."""
        key = self.get()
        key.verify(manifest)
        return key
