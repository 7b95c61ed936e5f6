"""Trainer side: expose this rank's parameter shards through shared-memory or CUDA IPC handles.

One :class:`WeightPublisher` per trainer rank, the :class:`~podrl.weights.protocol.Publisher`
of ``podrl.weights``; rank 0 merges the ranks' :class:`RankPublication` (plain protobuf bytes)
into one ``WeightManifest`` with its :class:`ManifestAssembler` (:meth:`WeightPublisher.update`).

The trainer must not change published storage while a generator may read it:

* **CPU** (``staging="shm"``, :class:`ShmStaging`): parameters are copied into a shared-memory
  *staging copy* when a version is published; the optimizer may step freely, but the next
  :meth:`~WeightPublisher.start` refreshes the staging copy and so waits until the previous
  version was acknowledged (:meth:`~WeightPublisher.finish`).
* **GPU** (``staging="live"``, :class:`CudaIpcExport`): the FSDP2 sharded parameters themselves
  are exported by CUDA IPC (no copy). The optimizer updates them in place, so the trainer calls
  :meth:`wait_for_acknowledgement` before every optimizer step while a version is pending.

A full manifest goes out the first time and whenever the storage fingerprint changes (or on
``force_full``); afterwards a manifest carries only the version ("the storage you mapped now
holds version v").

Weights holding NaN or infinity are never published: :meth:`WeightPublisher.start` refuses
them (:class:`PublishError`) before anything is marked pending; a trainer of several ranks
agrees on that first (``podrl.trainer.servicer``'s ``WeightPublishing``). The assembler
signs every manifest with the pod's weights key (``podrl.weights.protocol``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

import podrl.weights.cuda_ipc as cuda_ipc
import podrl.weights.protocol as protocol
from podrl.v1 import weights_pb2
from podrl.weights.errors import AcknowledgeError, PublishError
from podrl.weights.protocol import Publisher, RankPublication, WeightsKey, first_non_finite

StagingMode = Literal["auto", "shm", "live"]
"""shm: a shared-memory staging copy (CPU); live: the live parameters by CUDA IPC, no copy (GPU);
auto: live for CUDA parameters, else shm."""
DEFAULT_SEGMENT_BYTES = 1 << 30


class _Storage(Protocol):
    """Where a generator reads this rank's shards: a staging copy, or the live parameters."""

    handles: list[weights_pb2.TensorStorage]
    live: bool
    """True: the handles are the parameters themselves (the optimizer must wait for the ack)."""

    def refresh(self, shards: Sequence[protocol.LocalShard]) -> None:
        """Make the handles hold the shards' current values."""

    def close(self) -> None: ...


class ShmStaging:
    """Packed shared-memory copy of a set of local shards (many tensors per segment); the
    copy is contiguous whatever the source strides are."""

    live = False

    def __init__(self, shards: Sequence[protocol.LocalShard], segment_bytes: int) -> None:
        self.segments: list[protocol.SharedSegment] = []
        self.views: list[torch.Tensor] = []
        self.handles: list[weights_pb2.TensorStorage] = []
        layout: list[tuple[int, int]] = []  # (segment index, offset) per shard
        sizes: list[int] = [0]
        for shard in shards:
            nbytes = shard.tensor.numel() * shard.tensor.element_size()
            offset = -(-sizes[-1] // protocol.ALIGNMENT) * protocol.ALIGNMENT
            if offset + nbytes > segment_bytes and sizes[-1] > 0:
                sizes.append(0)
                offset = 0
            layout.append((len(sizes) - 1, offset))
            sizes[-1] = offset + nbytes
        try:
            self.segments = [protocol.SharedSegment(size) for size in sizes]
        except BaseException:
            self.close()
            raise
        for shard, (index, offset) in zip(shards, layout, strict=True):
            segment = self.segments[index]
            view = segment.view(offset, shard.tensor.dtype, tuple(shard.tensor.shape))
            self.views.append(view)
            self.handles.append(
                weights_pb2.TensorStorage(
                    shm=weights_pb2.ShmHandle(
                        name=segment.name,
                        offset=offset,
                        nbytes=view.numel() * view.element_size(),
                        segment_nbytes=segment.nbytes,
                    )
                )
            )

    def refresh(self, shards: Sequence[protocol.LocalShard]) -> None:
        with torch.no_grad():
            for view, shard in zip(self.views, shards, strict=True):
                view.copy_(shard.tensor)

    def close(self) -> None:
        for segment in self.segments:
            segment.unlink()
        self.segments = []
        self.views = []


class CudaIpcExport:
    """The live CUDA shards exported by CUDA IPC handles (no copy)."""

    live = True

    def __init__(self, shards: Sequence[protocol.LocalShard]) -> None:
        self.handles = [
            weights_pb2.TensorStorage(cuda_ipc=cuda_ipc.export_tensor(s.tensor)) for s in shards
        ]

    def refresh(self, shards: Sequence[protocol.LocalShard]) -> None:
        if any(shard.tensor.is_cuda for shard in shards):
            # Kernels of the last optimizer step must be done before anyone reads.
            torch.cuda.synchronize()

    def close(self) -> None:
        """Nothing to release: the handles name the parameters' own memory."""


@dataclass
class _StorageSnapshot:
    """The cheap per-publish storage check: the same parameter objects under the same names,
    each (local shard) still at the same data pointer.

    A version-only publish is the common case, and the full :func:`protocol.storage_key` walk
    (DTensor ``to_local``, shape and stride of ~300-400 parameters) cost a few hundred
    microseconds of the sync; this check is one attribute read and one ``data_ptr`` per
    parameter. Anything that re-allocates a parameter (``param.data = ...``, a checkpoint
    loaded into new tensors, FSDP2 re-sharding) moves its data pointer or replaces the object,
    and the full walk runs again.
    """

    names: list[str]
    objects: list[torch.Tensor]
    is_dtensor: list[bool]
    pointers: list[int]

    @classmethod
    def of(cls, params: Mapping[str, torch.Tensor]) -> _StorageSnapshot:
        from torch.distributed.tensor import DTensor

        objects = list(params.values())
        is_dtensor = [isinstance(p, DTensor) for p in objects]
        return cls(list(params), objects, is_dtensor, _pointers(objects, is_dtensor))

    def matches(self, params: Mapping[str, torch.Tensor]) -> bool:
        objects = list(params.values())
        return (
            len(objects) == len(self.objects)
            and all(a is b for a, b in zip(objects, self.objects, strict=True))
            and list(params) == self.names
            and _pointers(objects, self.is_dtensor) == self.pointers
        )


def _pointers(objects: Sequence[torch.Tensor], is_dtensor: Sequence[bool]) -> list[int]:
    return [
        (p._local_tensor if d else p).data_ptr()  # type: ignore[attr-defined]
        for p, d in zip(objects, is_dtensor, strict=True)
    ]


class WeightPublisher(Publisher):
    """Publishes one trainer rank's parameter shards; see the module docstring for the rules.

    ``params`` is the module whose ``named_parameters()`` are published (names in Hugging Face
    form, as FSDP2/TP leave them) or a callable returning a name -> tensor mapping.
    ``assembler``: rank 0's, which :meth:`update` merges and signs with; other ranks have none.
    """

    def __init__(
        self,
        params: torch.nn.Module | Callable[[], Mapping[str, torch.Tensor]],
        *,
        rank: int = 0,
        staging: StagingMode = "auto",
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        assembler: ManifestAssembler | None = None,
    ) -> None:
        if isinstance(params, torch.nn.Module):
            module = params
            self._params_fn: Callable[[], Mapping[str, torch.Tensor]] = lambda: dict(
                module.named_parameters()
            )
        else:
            self._params_fn = params
        if staging not in ("auto", "shm", "live"):
            raise ValueError(f"staging must be 'auto', 'shm' or 'live', not {staging!r}")
        self.rank = rank
        self._staging_mode = staging
        self._segment_bytes = segment_bytes
        self.assembler = assembler
        self._storage: _Storage | None = None
        self._fingerprint: str | None = None
        self._storage_key: tuple | None = None
        self._storage_snapshot: _StorageSnapshot | None = None
        self._local: list[protocol.LocalShard] = []
        self._shards: list[weights_pb2.TensorShard] = []
        self._pending: int | None = None
        self._last_acknowledged: int | None = None
        self._acked = threading.Condition()
        protocol.reap_orphaned_segments()

    # -- start: publish this rank's shards ----------------------------------------------------

    @property
    def pending_version(self) -> int | None:
        """The version published and not yet acknowledged (finished), if any."""
        with self._acked:
            return self._pending

    def non_finite_parameter(self) -> str | None:
        """The name of a local parameter shard holding NaN or infinity, or None (one cheap
        reduction over this rank's shards, :mod:`podrl.weights.protocol`)."""
        from torch.distributed.tensor import DTensor

        return first_non_finite(
            (name, param.to_local() if isinstance(param, DTensor) else param)
            for name, param in self._params_fn().items()
        )

    def start(
        self, version: int, *, ack_timeout: float = 0.0, check_finite: bool = True
    ) -> RankPublication:
        """See :meth:`Publisher.start`: refreshes the staging copy (CPU) or waits for the last
        optimizer step's kernels (GPU), then marks ``version`` pending."""
        if check_finite:
            bad = self.non_finite_parameter()
            if bad is not None:
                raise PublishError(non_finite_message(version, [(self.rank, bad)]))
        with self._acked:
            if self._pending is not None and self._pending != version:
                self._acked.wait_for(lambda: self._pending is None, timeout=ack_timeout)
                if self._pending is not None:
                    raise PublishError(
                        f"version {self._pending} is not acknowledged yet; the trainer may not "
                        f"overwrite published weights with version {version}"
                    )
        params = self._params_fn()
        if not self._same_storage(params):
            key = protocol.storage_key(params)
            if key != self._storage_key:
                # Storage changed (or first publish): describe the shards, new handles.
                local = protocol.local_shards(params)
                if not local:
                    raise PublishError(f"rank {self.rank} has no parameters to publish")
                self._rebuild(local, protocol.storage_fingerprint(local), self._publish_live(local))
                self._local, self._storage_key = local, key
            self._storage_snapshot = _StorageSnapshot.of(params)
        assert self._storage is not None and self._fingerprint is not None
        self._storage.refresh(self._local)
        with self._acked:
            self._pending = version
        return RankPublication(rank=self.rank, fingerprint=self._fingerprint, shards=self._shards)

    def _same_storage(self, params: Mapping[str, torch.Tensor]) -> bool:
        """The cheap check that the parameters' storage is what the last publish described
        (:class:`_StorageSnapshot`); False sends :meth:`start` through the full walk."""
        snapshot = self._storage_snapshot
        return snapshot is not None and snapshot.matches(params)

    def _publish_live(self, local: Sequence[protocol.LocalShard]) -> bool:
        """True: export the live parameters (CUDA IPC); False: a shared-memory staging copy."""
        on_cuda = all(shard.tensor.is_cuda for shard in local)
        if self._staging_mode == "live" and not on_cuda:
            raise PublishError("staging='live' needs CUDA parameters; CPU weights use 'shm'")
        return on_cuda if self._staging_mode == "auto" else self._staging_mode == "live"

    def _rebuild(self, local: Sequence[protocol.LocalShard], fingerprint: str, live: bool) -> None:
        if self._storage is not None:
            self._storage.close()
            self._storage = None
        storage: _Storage = CudaIpcExport(local) if live else ShmStaging(local, self._segment_bytes)
        self._storage = storage
        self._shards = []
        for shard, handle in zip(local, storage.handles, strict=True):
            message = shard.to_wire(handle, self.rank)
            if not live:
                message.stride[:] = list(protocol.contiguous_strides(shard.tensor.shape))
            self._shards.append(message)
        self._fingerprint = fingerprint

    # -- update: rank 0 assembles the manifest ------------------------------------------------

    def update(
        self, version: int, parts: Sequence[RankPublication], *, force_full: bool = False
    ) -> weights_pb2.WeightManifest:
        """See :meth:`Publisher.update` (rank 0, which holds the assembler)."""
        if self.assembler is None:
            raise PublishError(
                f"rank {self.rank}'s publisher has no assembler: only rank 0 assembles manifests"
            )
        return self.assembler.assemble(version, parts, force_full=force_full)

    # -- finish: the acknowledgement -----------------------------------------------------------

    def finish(self, version: int) -> None:
        """The generator(s) applied ``version``, the pending one: storage may change again.

        A repeat of the last acknowledged version (a retry whose first reply was lost) is
        answered and releases nothing. Any other version raises :class:`AcknowledgeError`
        naming the pending one, and nothing is released: an acknowledgement of a version that
        was never published must not let the trainer overwrite weights a generator may still
        be reading."""
        with self._acked:
            if self._pending is not None and version == self._pending:
                self._pending = None
                self._last_acknowledged = version
                self._acked.notify_all()
                return
            if version == self._last_acknowledged:
                return
            pending = "none" if self._pending is None else str(self._pending)
            raise AcknowledgeError(
                f"version: {version} is not the pending version (pending: {pending}, last "
                f"acknowledged: {self._last_acknowledged}); acknowledge the version "
                "PublishWeights returned, after its ApplyWeights"
            )

    def wait_for_acknowledgement(self, timeout: float | None = None) -> bool:
        """Block until no version is pending; False on timeout. GPU trainers call this before
        each optimizer step (the step would write into storage a generator may be reading)."""
        with self._acked:
            return self._acked.wait_for(lambda: self._pending is None, timeout=timeout)

    @property
    def must_wait_before_step(self) -> bool:
        """True when the optimizer may not touch the parameters yet (live GPU publishing)."""
        live = self._storage is not None and self._storage.live
        return live and self.pending_version is not None

    def close(self) -> None:
        """Unlink this publisher's shared-memory segments (also done at interpreter exit)."""
        if self._storage is not None:
            self._storage.close()
            self._storage = None
        self._fingerprint = None
        self._storage_key = None
        self._storage_snapshot = None
        protocol.reap_orphaned_segments()


def non_finite_message(version: int, bad: Sequence[tuple[int, str]]) -> str:
    """Why version ``version`` is not published: (rank, parameter) pairs holding NaN/inf."""
    where = ", ".join(f"rank {rank}: {name}" for rank, name in bad) or "on another rank"
    return (
        f"version {version} is not published: its weights hold NaN or infinity ({where}); the "
        "generators keep the last version they applied. Load a checkpoint of good weights"
    )


class ManifestAssembler:
    """Rank 0: merges every rank's publication into one manifest, full or version-only, signed
    with the pod's weights ``key`` (unsigned without one: no generator accepts it then)."""

    def __init__(self, publisher_id: str, key: WeightsKey | None = None) -> None:
        self.publisher_id = publisher_id
        self.key = key
        self._last_fingerprint: str | None = None

    def assemble(
        self, version: int, parts: Sequence[RankPublication], *, force_full: bool = False
    ) -> weights_pb2.WeightManifest:
        parts = sorted(parts, key=lambda part: part.rank)
        fingerprint = protocol.combine_fingerprints(part.fingerprint for part in parts)
        full = force_full or fingerprint != self._last_fingerprint
        message = weights_pb2.WeightManifest(
            version=version,
            model_fingerprint=fingerprint,
            version_only=not full,
            publisher_id=self.publisher_id,
        )
        if full:
            for part in parts:
                message.shards.extend(part.shards)
        if self.key is not None:
            self.key.sign(message)
        self._last_fingerprint = fingerprint
        return message
