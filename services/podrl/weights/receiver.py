"""Generator side: validate a manifest, open its handles once, and run the cached copy plan.

Two ways to consume (pick with ``destinations``):

(a) in place: ``receiver.apply(manifest, destinations=dict(vllm_model.named_parameters()))``
    with a :func:`~podrl.weights.architectures.vllm_layout` — copies straight into vLLM's own
    (fused, TP-sliced) parameters. For GPUs, where unquantized weights are plain tensors.
(b) materialised: ``for hf_name, tensor in receiver.apply(manifest): ...`` with the default
    :func:`~podrl.weights.architectures.hf_layout` — full tensors in HF naming and the target
    dtype, held in buffers the receiver owns and reuses (valid until the next ``apply``), for
    vLLM's reload path (``model.load_weights``) on the CPU backend, which repacks linear weights.

``apply`` validates everything and opens every handle before it copies anything, so a rejected
manifest (:class:`~podrl.weights.errors.ManifestError`) leaves the receiver and the destinations
as they were. When it returns, every copy has finished: the trainer's storage is no longer read.

The receiver checks what it needs to copy (publisher, names, shapes, dtypes, tiling, storage,
and for a version-only manifest that it holds a plan for that storage); it does not order
versions. Which version a generator serves, and whether a manifest may replace it, is
``podrl.generator.weight_state``'s to decide (one place), after the copy *and* vLLM's load.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from podrl.v1 import weights_pb2
from podrl.weights import codec, cuda_ipc, dtypes, shm
from podrl.weights.architectures import ModelDescription, TargetLayout, hf_layout
from podrl.weights.errors import ManifestError, ManifestErrorKind
from podrl.weights.plan import DEFAULT_COPY_STREAMS, CopyPlan, SourceShard

Kind = ManifestErrorKind


@dataclass
class CopiedWeights:
    """Result of one ``apply``: iterate it for (name, tensor) pairs in the layout's naming."""

    version: int
    """The manifest's version (what the tensors now hold)."""
    plan_cached: bool
    seconds: float
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


@dataclass
class _Cached:
    fingerprint: str
    shards_bytes: bytes
    sources: dict[str, list[SourceShard]]
    plan: CopyPlan
    destinations: Mapping[str, torch.Tensor]
    owns_destinations: bool


class WeightReceiver:
    """Applies manifests from one trainer to one model replica (one generator TP rank).

    Args:
        description: the parameters the model has (HF names and global shapes).
        layout: target tensors; default = full HF tensors (:func:`hf_layout`).
        dtype: dtype of the buffers the receiver allocates (consumption (b)); with
            ``destinations`` the destinations' own dtype is used (copy casts).
        device: where receiver-owned buffers live.
        trusted_publisher_id: when set, manifests from any other publisher are refused.
        copy_streams: parallel branches of the CUDA graph a single-GPU plan is captured as
            (1 = one stream, the previous plan).
        map_on_destination: map CUDA IPC sources of another GPU on the destinations' GPU
            (peer access), so a cross-GPU plan is a single-GPU plan reading over NVLink (only
            when no cast is needed); False maps them on their own GPU (a cross-device copy
            per slice).
    """

    def __init__(
        self,
        description: ModelDescription,
        *,
        layout: TargetLayout | None = None,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        trusted_publisher_id: str | None = None,
        copy_streams: int = DEFAULT_COPY_STREAMS,
        map_on_destination: bool = True,
    ) -> None:
        self.description = description
        self.layout = layout if layout is not None else hf_layout(description)
        self.dtype = dtypes.parse_dtype(dtype)
        self.device = torch.device(device)
        self.trusted_publisher_id = trusted_publisher_id
        self.copy_streams = copy_streams
        self.map_on_destination = map_on_destination
        self._cached: _Cached | None = None
        shm.reap_orphaned_segments()

    @property
    def fingerprint(self) -> str | None:
        return self._cached.fingerprint if self._cached else None

    # -- validation --------------------------------------------------------------------------

    def validate(self, manifest: weights_pb2.WeightManifest) -> None:
        """Raise :class:`ManifestError` unless ``manifest`` can be applied now."""
        if self.trusted_publisher_id is not None and (
            manifest.publisher_id != self.trusted_publisher_id
        ):
            raise ManifestError(
                Kind.UNTRUSTED,
                f"publisher_id {manifest.publisher_id!r} is not this pod's trainer "
                f"({self.trusted_publisher_id!r})",
            )
        if manifest.version_only:
            if self._cached is None or self._cached.fingerprint != manifest.model_fingerprint:
                raise ManifestError(
                    Kind.FINGERPRINT,
                    f"version-only manifest for storage {manifest.model_fingerprint[:12]!r}, but "
                    f"the receiver holds {self.fingerprint and self.fingerprint[:12]!r}; the "
                    "trainer must publish a full manifest (force_full)",
                )
            return
        if not manifest.model_fingerprint:
            raise ManifestError(Kind.FINGERPRINT, "full manifest without model_fingerprint")
        self._validate_shards(manifest.shards)

    def _validate_shards(self, shards: list[weights_pb2.TensorShard]) -> None:
        expected = self.description.params
        by_name: dict[str, list[weights_pb2.TensorShard]] = {}
        for shard in shards:
            name = shard.name
            if name not in expected:
                raise ManifestError(
                    Kind.UNKNOWN_NAME, f"{name!r} is not a parameter of this model", name=name
                )
            dtype = dtypes.from_wire(shard.dtype)
            if dtype not in dtypes.CASTABLE_FLOAT_DTYPES:
                raise ManifestError(
                    Kind.DTYPE,
                    f"{name}: dtype {dtypes.wire_name(shard.dtype)} cannot be cast into the "
                    f"model's floating weights (use float32, bfloat16 or float16)",
                    name=name,
                )
            global_shape = tuple(shard.global_shape)
            if global_shape != expected[name]:
                raise ManifestError(
                    Kind.SHAPE,
                    f"{name}: global_shape {global_shape}, the model has {expected[name]}",
                    name=name,
                )
            self._validate_local(shard, dtype)
            previous = by_name.setdefault(name, [])
            if previous and previous[0].dtype != shard.dtype:
                raise ManifestError(Kind.DTYPE, f"{name}: shards disagree on dtype", name=name)
            previous.append(shard)
        missing = [name for name in expected if name not in by_name]
        if missing:
            raise ManifestError(
                Kind.MISSING_NAME,
                f"{len(missing)} parameters have no shard, e.g. {missing[:3]}",
                name=missing[0],
            )
        for name, group in by_name.items():
            _check_tiling(name, expected[name], group)

    @staticmethod
    def _validate_local(shard: weights_pb2.TensorShard, dtype: torch.dtype) -> None:
        name = shard.name
        ndim = len(shard.global_shape)
        if not (len(shard.local_shape) == len(shard.local_offset) == len(shard.stride) == ndim):
            raise ManifestError(
                Kind.SHAPE,
                f"{name}: local_shape/local_offset/stride must have {ndim} entries",
                name=name,
            )
        for size, offset, full in zip(
            shard.local_shape, shard.local_offset, shard.global_shape, strict=True
        ):
            if size < 0 or offset < 0 or offset + size > full:
                raise ManifestError(
                    Kind.SHAPE,
                    f"{name}: block offset {list(shard.local_offset)} shape "
                    f"{list(shard.local_shape)} lies outside {list(shard.global_shape)}",
                    name=name,
                )
        if len(shard.placements) != len(shard.mesh.shape):
            raise ManifestError(
                Kind.PLACEMENT, f"{name}: one placement per mesh dimension expected", name=name
            )
        for placement in shard.placements:
            if placement.WhichOneof("kind") == "partial":
                raise ManifestError(
                    Kind.PLACEMENT,
                    f"{name}: Partial placement; the trainer must reduce before publishing",
                    name=name,
                )
        storage = shard.storage.WhichOneof("kind")
        nbytes = math.prod(shard.local_shape) * dtypes.element_size(dtype)
        if storage == "shm":
            if tuple(shard.stride) != codec.contiguous_strides(shard.local_shape):
                raise ManifestError(
                    Kind.SHAPE, f"{name}: shared-memory shards must be contiguous", name=name
                )
            if shard.storage.shm.nbytes != nbytes:
                raise ManifestError(
                    Kind.SHAPE,
                    f"{name}: shm nbytes {shard.storage.shm.nbytes} != {nbytes} for "
                    f"{list(shard.local_shape)} x {dtype}",
                    name=name,
                )
            if shm.segment_creator(shard.storage.shm.name) is None:
                raise ManifestError(
                    Kind.STORAGE, f"{name}: {shard.storage.shm.name!r} is not a podrl segment"
                )
        elif storage == "cuda_ipc":
            span = sum((s - 1) * st for s, st in zip(shard.local_shape, shard.stride, strict=True))
            end = shard.storage.cuda_ipc.tensor_offset + (span + 1) * dtypes.element_size(dtype)
            if nbytes and end > shard.storage.cuda_ipc.nbytes:
                raise ManifestError(
                    Kind.SHAPE, f"{name}: shard reaches past its CUDA storage", name=name
                )
        else:
            raise ManifestError(Kind.STORAGE, f"{name}: shard has no storage handle", name=name)

    # -- applying ----------------------------------------------------------------------------

    def apply(
        self,
        manifest: weights_pb2.WeightManifest,
        destinations: Mapping[str, torch.Tensor] | None = None,
        *,
        before_copy: Callable[[], None] | None = None,
    ) -> CopiedWeights:
        """Validate, (re)plan if the storage changed, copy; returns the filled tensors.

        ``destinations`` (name -> tensor in the layout's naming) are copied into in place;
        without them the receiver fills buffers of its own (allocated once per fingerprint).
        ``before_copy`` runs after every check passed and every handle is open, right before
        the first byte is written (the generator marks its served weights as being touched).
        """
        started = time.perf_counter()
        self.validate(manifest)
        cached = self._cached
        reuse = cached is not None and (
            manifest.version_only
            or (
                cached.fingerprint == manifest.model_fingerprint
                and cached.shards_bytes == _shards_bytes(manifest)
            )
        )
        if reuse and destinations is not None and cached.destinations is not destinations:
            reuse = all(destinations[name] is cached.destinations[name] for name in self.layout)
        if not reuse:
            cached = self._compile(manifest, destinations)
        if before_copy is not None:
            before_copy()
        # Cached before the copy: a copy that fails half-way leaves the plan valid (the next
        # apply of this storage rewrites every destination).
        self._cached = cached
        cached.plan.run()
        return CopiedWeights(
            version=manifest.version,
            plan_cached=reuse,
            seconds=time.perf_counter() - started,
            tensors=[(name, cached.destinations[name]) for name in self.layout],
        )

    def _compile(
        self,
        manifest: weights_pb2.WeightManifest,
        destinations: Mapping[str, torch.Tensor] | None,
    ) -> _Cached:
        owns = destinations is None
        if destinations is None:
            destinations = {
                name: torch.zeros(target.shape, dtype=self.dtype, device=self.device)
                for name, target in self.layout.items()
            }
        else:
            missing = [name for name in self.layout if name not in destinations]
            if missing:
                raise ValueError(f"destinations lack {len(missing)} tensors, e.g. {missing[:3]}")
        # Peer sources are mapped on the destination GPU only for plain copies: a cast kernel
        # there would pull the wider source dtype over NVLink (measured on H200s, 1.7B
        # fp32 -> bf16: 18.5 ms, against 13.9 ms casting on the source GPU, which sends bf16).
        gpus = {t.device.index for t in destinations.values() if t.is_cuda}
        same_dtype = {t.dtype for t in destinations.values()} == {
            dtypes.from_wire(shard.dtype) for shard in manifest.shards
        }
        on_device = None
        if self.map_on_destination and len(gpus) == 1 and same_dtype:
            on_device = gpus.pop()
        sources = _open_sources(manifest.shards, on_device)
        plan = CopyPlan.compile(sources, self.layout, destinations, streams=self.copy_streams)
        return _Cached(
            fingerprint=manifest.model_fingerprint,
            shards_bytes=_shards_bytes(manifest),
            sources=sources,
            plan=plan,
            destinations=destinations,
            owns_destinations=owns,
        )

    def close(self) -> None:
        """Drop mapped handles and buffers; unlink segments of trainers that are gone."""
        self._cached = None
        shm.reap_orphaned_segments()


def _shards_bytes(manifest: weights_pb2.WeightManifest) -> bytes:
    return b"".join(shard.SerializeToString(deterministic=True) for shard in manifest.shards)


def _check_tiling(
    name: str, global_shape: tuple[int, ...], shards: list[weights_pb2.TensorShard]
) -> None:
    """Distinct shard blocks (replicas dropped) must cover the global tensor exactly once."""
    boxes = list({codec.shard_box(shard) for shard in shards})
    total = sum(box.numel for box in boxes)
    overlapping = any(
        boxes[i].intersect(boxes[j]) is not None
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
    )
    if overlapping or total != math.prod(global_shape):
        raise ManifestError(
            Kind.COVERAGE,
            f"{name}: {len(boxes)} distinct shard blocks cover {total} of "
            f"{math.prod(global_shape)} elements{' and overlap' if overlapping else ''}",
            name=name,
        )


def _open_sources(
    shards: list[weights_pb2.TensorShard], on_device: int | None = None
) -> dict[str, list[SourceShard]]:
    """Open every distinct shard once (replicas are skipped); STORAGE error if one fails.

    ``on_device``: the GPU to map CUDA IPC storage on (see :func:`cuda_ipc.open_storage`).
    """
    segments: dict[str, torch.Tensor] = {}
    sources: dict[str, list[SourceShard]] = {}
    seen: set[tuple[str, codec.Box]] = set()
    for shard in shards:
        box = codec.shard_box(shard)
        if (shard.name, box) in seen:
            continue
        seen.add((shard.name, box))
        dtype = dtypes.from_wire(shard.dtype)
        assert dtype is not None  # validated
        try:
            tensor = _open_shard(shard, dtype, segments, on_device)
        except (OSError, LookupError, RuntimeError, ValueError) as exc:
            raise ManifestError(
                Kind.STORAGE, f"{shard.name}: cannot open its storage: {exc}", name=shard.name
            ) from exc
        sources.setdefault(shard.name, []).append(SourceShard(box, tensor))
    return sources


def _open_shard(
    shard: weights_pb2.TensorShard,
    dtype: torch.dtype,
    segments: dict[str, torch.Tensor],
    on_device: int | None = None,
) -> torch.Tensor:
    shape = tuple(shard.local_shape)
    if shard.storage.WhichOneof("kind") == "shm":
        handle = shard.storage.shm
        if not shm.creator_alive(handle.name):
            raise FileNotFoundError(
                f"the creator of {handle.name} is not running (or not visible: trainer and "
                "generator need one PID namespace, shareProcessNamespace: true)"
            )
        if handle.name not in segments:
            segments[handle.name] = shm.open_segment_readonly(handle.name)
        data = segments[handle.name]
        if handle.offset + handle.nbytes > data.numel():
            raise ValueError(f"{handle.name} is smaller than offset + nbytes")
        return data[handle.offset : handle.offset + handle.nbytes].view(dtype).view(shape)
    handle = shard.storage.cuda_ipc
    storage, index = cuda_ipc.open_storage(handle, on_device=on_device)
    element = dtypes.element_size(dtype)
    tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    return tensor.set_(storage, handle.tensor_offset // element, shape, tuple(shard.stride))
