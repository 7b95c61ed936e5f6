"""Generator side: validate a manifest, open its handles once, and run the cached copy plan.

:class:`WeightReceiver` is the :class:`~podrl.weights.protocol.Receiver` of ``podrl.weights``:
``start`` validates the manifest, plans and opens, ``update`` copies, ``finish`` returns the
filled tensors; ``apply`` runs the three.

Two ways to consume (pick with ``destinations``):

(a) in place: ``receiver.apply(manifest, destinations=dict(vllm_model.named_parameters()))``
    with a :func:`vllm_layout` — copies straight into vLLM's own
    (fused, TP-sliced) parameters. For GPUs, where unquantized weights are plain tensors.
(b) materialised: ``for hf_name, tensor in receiver.apply(manifest): ...`` with the default
    :func:`hf_layout` — full tensors in HF naming and the target
    dtype, held in buffers the receiver owns and reuses (valid until the next ``apply``), for
    vLLM's reload path (``model.load_weights``) on the CPU backend, which repacks linear weights.

``start`` validates everything and opens every handle before anything is copied, so a rejected
manifest (:class:`~podrl.weights.errors.ManifestError`) leaves the receiver and the destinations
as they were. When ``update`` returns, every copy has finished: the trainer's storage is no
longer read.

The receiver checks what it needs to copy (the MAC when it holds the pod's weights key,
publisher, names, shapes, dtypes, tiling, storage, and for a version-only manifest that it holds
a plan for that storage), in time linear in the shards (sorting aside) and with caps on their
number, and that the weights it is about to copy are all finite; it does not order versions.
Which version a generator serves, and whether a manifest may replace it, is
``podrl.generator.worker_extension``'s to decide (one place), after the copy *and* vLLM's load.

The receiver's two parts are here too: what it expects (the model's parameters and how each maps
onto vLLM's layout, :class:`ModelDescription`, :func:`vllm_layout`, :func:`hf_layout`) and the copy
plan it compiles once per storage fingerprint (:class:`CopyPlan`).
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

import podrl.weights.cuda_ipc as cuda_ipc
import podrl.weights.protocol as protocol
from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind
from podrl.weights.protocol import Box, CopiedWeights, FiniteCheck, Receiver, WeightsKey

# -- what a receiver expects: target layouts -------------------------------------------------------
#
# What a receiver expects: the model's parameters (HF names, shapes) and how each maps onto
# vLLM's layout. The HF -> vLLM name mapping is ONE TABLE PER ARCHITECTURE below.
#
# vLLM fuses ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj`` and ``gate_proj``/``up_proj`` into
# ``gate_up_proj`` (concatenated on dim 0, each part sliced per tensor-parallel rank), splits the
# row-parallel ``o_proj``/``down_proj`` on dim 1, splits the vocab-parallel ``embed_tokens`` /
# ``lm_head`` on dim 0 (vocabulary padded to a multiple of 64) and replicates norms.


VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE


class Split(enum.Enum):
    REPLICATED = "replicated"
    ROW = "row"  # split on dim 1 (row-parallel linear weight)
    VOCAB = "vocab"  # split on dim 0 after padding the vocabulary
    Q = "q"  # parts of the fused qkv_proj
    K = "k"
    V = "v"
    GATE = "gate"  # parts of the fused gate_up_proj
    UP = "up"


@dataclass(frozen=True)
class NameRule:
    """HF parameter names matching ``pattern`` become ``target`` (``re.sub`` template)."""

    pattern: str
    target: str
    split: Split


# fmt: off
# Llama-style decoders: vLLM fuses q/k/v into qkv_proj and gate/up into gate_up_proj.
LLAMA_TABLE: tuple[NameRule, ...] = (
    NameRule(r"^model\.embed_tokens\.weight$", r"model.embed_tokens.weight", Split.VOCAB),
    NameRule(r"^lm_head\.weight$", r"lm_head.weight", Split.VOCAB),
    NameRule(r"^model\.norm\.weight$", r"model.norm.weight", Split.REPLICATED),
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.q_proj\.(weight|bias)$", r"\1.self_attn.qkv_proj.\2", Split.Q),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.k_proj\.(weight|bias)$", r"\1.self_attn.qkv_proj.\2", Split.K),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.v_proj\.(weight|bias)$", r"\1.self_attn.qkv_proj.\2", Split.V),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.o_proj\.weight$", r"\1.self_attn.o_proj.weight", Split.ROW),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.o_proj\.bias$", r"\1.self_attn.o_proj.bias", Split.REPLICATED),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.mlp\.gate_proj\.weight$", r"\1.mlp.gate_up_proj.weight", Split.GATE),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.mlp\.up_proj\.weight$", r"\1.mlp.gate_up_proj.weight", Split.UP),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.mlp\.down_proj\.weight$", r"\1.mlp.down_proj.weight", Split.ROW),  # noqa: E501
    NameRule(r"^(model\.layers\.\d+)\.(input_layernorm|post_attention_layernorm)\.weight$", r"\1.\2.weight", Split.REPLICATED),  # noqa: E501
)

# Qwen3 = the Llama layout plus per-head RMS norms on queries and keys (replicated).
QWEN3_TABLE: tuple[NameRule, ...] = (
    *LLAMA_TABLE,
    NameRule(r"^(model\.layers\.\d+)\.self_attn\.(q_norm|k_norm)\.weight$", r"\1.self_attn.\2.weight", Split.REPLICATED),  # noqa: E501
)
# fmt: on

ARCHITECTURE_TABLES: dict[str, tuple[NameRule, ...]] = {
    "Qwen3ForCausalLM": QWEN3_TABLE,
    "LlamaForCausalLM": LLAMA_TABLE,
}


@dataclass(frozen=True)
class ModelDescription:
    """The parameters a receiver expects (HF names -> global shapes) and the attention shape."""

    architecture: str
    params: Mapping[str, tuple[int, ...]]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    intermediate_size: int

    @classmethod
    def from_hf_config(cls, config: Mapping[str, object] | object) -> ModelDescription:
        """From a Hugging Face config (``config.json`` dict or ``PretrainedConfig``)."""
        cfg = dict(config) if isinstance(config, Mapping) else config.to_dict()
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in ARCHITECTURE_TABLES:
            raise ValueError(
                f"architecture {arch!r} has no weight-transfer table; "
                f"supported: {sorted(ARCHITECTURE_TABLES)}"
            )
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        inter = int(cfg["intermediate_size"])
        vocab = int(cfg["vocab_size"])
        attn_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
        params: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
        for i in range(int(cfg["num_hidden_layers"])):
            p = f"model.layers.{i}"
            params[f"{p}.input_layernorm.weight"] = (hidden,)
            params[f"{p}.post_attention_layernorm.weight"] = (hidden,)
            for proj, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                params[f"{p}.self_attn.{proj}_proj.weight"] = (rows * head_dim, hidden)
                if attn_bias:
                    params[f"{p}.self_attn.{proj}_proj.bias"] = (rows * head_dim,)
            params[f"{p}.self_attn.o_proj.weight"] = (hidden, heads * head_dim)
            if attn_bias:
                params[f"{p}.self_attn.o_proj.bias"] = (hidden,)
            if arch == "Qwen3ForCausalLM":
                params[f"{p}.self_attn.q_norm.weight"] = (head_dim,)
                params[f"{p}.self_attn.k_norm.weight"] = (head_dim,)
            params[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
            params[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
            params[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
            if mlp_bias:
                raise ValueError("mlp_bias=True is not supported by the weight-transfer table")
        params["model.norm.weight"] = (hidden,)
        if not cfg.get("tie_word_embeddings", False):
            params["lm_head.weight"] = (vocab, hidden)
        return cls(
            architecture=arch,
            params=params,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            intermediate_size=inter,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelDescription:
        """From a Hugging Face model folder's ``config.json`` (what vLLM loads)."""
        path = Path(model_dir) / "config.json"
        return cls.from_hf_config(json.loads(path.read_text()))


@dataclass
class TargetPiece:
    """Copy ``src`` (a block of HF tensor ``hf_name``) to ``dst_offset`` of the target tensor."""

    hf_name: str
    src: Box
    dst_offset: tuple[int, ...]


@dataclass
class TargetTensor:
    """One tensor the receiver fills, and which blocks of which HF tensors go where."""

    name: str
    shape: tuple[int, ...]
    pieces: list[TargetPiece] = field(default_factory=list)


TargetLayout = Mapping[str, TargetTensor]


def hf_layout(description: ModelDescription) -> dict[str, TargetTensor]:
    """Full tensors in HF naming (vLLM's reload path / ``load_weights`` takes these)."""
    return {
        name: TargetTensor(
            name, shape, [TargetPiece(name, Box((0,) * len(shape), shape), (0,) * len(shape))]
        )
        for name, shape in description.params.items()
    }


def _rule_for(table: tuple[NameRule, ...], name: str) -> tuple[NameRule, str] | None:
    for rule in table:
        if re.match(rule.pattern, name):
            return rule, re.sub(rule.pattern, rule.target, name)
    return None


def _check_divisible(what: str, size: int, tp_size: int) -> int:
    if size % tp_size:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size {tp_size}")
    return size // tp_size


def vllm_layout(
    description: ModelDescription, tp_rank: int, tp_size: int
) -> dict[str, TargetTensor]:
    """vLLM's parameters on tensor-parallel rank ``tp_rank`` of ``tp_size`` (vLLM naming)."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    table = ARCHITECTURE_TABLES[description.architecture]
    hd = description.head_dim
    q_heads = _check_divisible("num_attention_heads", description.num_attention_heads, tp_size)
    kv_total = description.num_key_value_heads
    if tp_size >= kv_total:
        # vLLM replicates KV heads: each rank holds one, shared by tp_size // kv_total ranks.
        if tp_size % kv_total:
            raise ValueError(f"tensor_parallel_size {tp_size} is not a multiple of {kv_total}")
        kv_heads, kv_first = 1, tp_rank // (tp_size // kv_total)
    else:
        kv_heads = _check_divisible("num_key_value_heads", kv_total, tp_size)
        kv_first = tp_rank * kv_heads
    inter = _check_divisible("intermediate_size", description.intermediate_size, tp_size)
    padded_vocab = -(-description.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    vocab_per_rank = _check_divisible("padded vocab", padded_vocab, tp_size)

    targets: dict[str, TargetTensor] = {}
    for hf_name, shape in description.params.items():
        found = _rule_for(table, hf_name)
        if found is None:
            raise ValueError(f"{hf_name}: no rule in the {description.architecture} table")
        rule, target_name = found
        rest = shape[1:]
        zeros_rest = (0,) * len(rest)
        if rule.split is Split.REPLICATED:
            target_shape, src, dst = shape, Box((0,) * len(shape), shape), (0,) * len(shape)
        elif rule.split is Split.ROW:
            cols = _check_divisible(f"{hf_name} dim 1", shape[1], tp_size)
            target_shape = (shape[0], cols)
            src, dst = Box((0, tp_rank * cols), target_shape), (0, 0)
        elif rule.split is Split.VOCAB:
            start = tp_rank * vocab_per_rank
            rows = max(0, min(vocab_per_rank, description.vocab_size - start))
            target_shape = (vocab_per_rank, *rest)
            src, dst = Box((start, *zeros_rest), (rows, *rest)), (0, *zeros_rest)
        elif rule.split in (Split.Q, Split.K, Split.V):
            q_rows, kv_rows = q_heads * hd, kv_heads * hd
            target_shape = (q_rows + 2 * kv_rows, *rest)
            if rule.split is Split.Q:
                src = Box((tp_rank * q_rows, *zeros_rest), (q_rows, *rest))
                dst = (0, *zeros_rest)
            else:
                src = Box((kv_first * hd, *zeros_rest), (kv_rows, *rest))
                at = q_rows if rule.split is Split.K else q_rows + kv_rows
                dst = (at, *zeros_rest)
        else:  # GATE / UP
            target_shape = (2 * inter, *rest)
            src = Box((tp_rank * inter, *zeros_rest), (inter, *rest))
            dst = (0 if rule.split is Split.GATE else inter, *zeros_rest)
        target = targets.setdefault(target_name, TargetTensor(target_name, target_shape))
        if target.shape != target_shape:
            raise ValueError(
                f"{target_name}: parts disagree on shape ({target.shape} vs {target_shape})"
            )
        if src.numel:
            target.pieces.append(TargetPiece(hf_name, src, dst))
    return targets


# -- the copy plan ---------------------------------------------------------------------------------
#
# The copy plan: (opened source shards, target layout, destination tensors) -> slice copies.
#
# Compiled once per storage fingerprint. Every op is a pair of tensor *views* — a block of a
# source shard mapped from the trainer and the matching block of a destination tensor — so running
# the plan for a new version is only ``dst.copy_(src)`` per op (slice, cast and copy in one).


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


# -- the receiver ----------------------------------------------------------------------------------


Kind = ManifestErrorKind

MAX_SHARDS_PER_TENSOR = 256
"""Most shards (replicas included) one parameter may have in a manifest: one per trainer rank
holding it, and a pod's trainer has at most a few dozen ranks. A manifest over the cap is
refused (``LIMIT``); so is one with more than this many per parameter of the model in all,
before its shards are looked at one by one (:func:`check_shard_count`, which the generator runs
before it takes any lock)."""


@dataclass
class _Cached:
    fingerprint: str
    shards_bytes: bytes
    sources: dict[str, list[SourceShard]]
    plan: CopyPlan
    finite: FiniteCheck
    """The finiteness check over ``sources`` (prepared once, like the plan)."""
    destinations: Mapping[str, torch.Tensor]
    owns_destinations: bool


@dataclass
class _Started:
    """An update between :meth:`WeightReceiver.start` and its :meth:`~WeightReceiver.finish`."""

    version: int
    cached: _Cached
    reused: bool
    """The copy plan (and opened handles) of an earlier update serve this one."""
    started: float
    copied: bool = False


class WeightReceiver(Receiver):
    """Applies manifests from one trainer to one model replica (one generator TP rank).

    Args:
        description: the parameters the model has (HF names and global shapes).
        layout: target tensors; default = full HF tensors (:func:`hf_layout`).
        dtype: dtype of the buffers the receiver allocates (consumption (b)); with
            ``destinations`` the destinations' own dtype is used (copy casts).
        device: where receiver-owned buffers live.
        trusted_publisher_id: when set, manifests from any other publisher are refused.
        key: the pod's weights key; when set, a manifest without its MAC is refused
            (``UNAUTHENTIC``). The generator checks the MAC itself before it takes its write
            lock, so its workers' receivers go without.
        segment_owner_uid: the user whose shared-memory segments may be opened (the trainer's);
            default: ``key.owner_uid`` with a key, else this process's user.
        check_finite: refuse (``NON_FINITE``) weights holding NaN or infinity, checked on the
            opened sources right before the copy (one reduction over them).
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
        key: WeightsKey | None = None,
        segment_owner_uid: int | None = None,
        check_finite: bool = True,
    ) -> None:
        self.description = description
        self.layout = layout if layout is not None else hf_layout(description)
        self.dtype = protocol.parse_dtype(dtype)
        self.device = torch.device(device)
        self.trusted_publisher_id = trusted_publisher_id
        self.copy_streams = copy_streams
        self.map_on_destination = map_on_destination
        self.key = key
        if segment_owner_uid is None:
            segment_owner_uid = key.owner_uid if key is not None else os.geteuid()
        self.segment_owner_uid = segment_owner_uid
        self.check_finite = check_finite
        self._cached: _Cached | None = None
        self._started: _Started | None = None
        protocol.reap_orphaned_segments()

    @property
    def fingerprint(self) -> str | None:
        return self._cached.fingerprint if self._cached else None

    # -- validation --------------------------------------------------------------------------

    def validate(self, manifest: weights_pb2.WeightManifest) -> None:
        """Raise :class:`ManifestError` unless ``manifest`` can be applied now. (The shard
        count in all was checked before the manifest got here: ``check_shard_count``.)"""
        if self.key is not None:
            self.key.verify(manifest)
        if self.trusted_publisher_id is not None and (
            manifest.publisher_id != self.trusted_publisher_id
        ):
            raise ManifestError(
                Kind.UNTRUSTED,
                f"publisher_id {manifest.publisher_id!r} is not this pod's trainer "
                f"({self.trusted_publisher_id!r})",
            )
        if manifest.version_only:
            if manifest.shards:
                raise ManifestError(Kind.SHAPE, "a version-only manifest must carry no shards")
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
            dtype = protocol.from_wire(shard.dtype)
            if dtype not in protocol.CASTABLE_FLOAT_DTYPES:
                raise ManifestError(
                    Kind.DTYPE,
                    f"{name}: dtype {protocol.wire_name(shard.dtype)} cannot be cast into the "
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
            if len(previous) >= MAX_SHARDS_PER_TENSOR:
                raise ManifestError(
                    Kind.LIMIT,
                    f"{name}: more than {MAX_SHARDS_PER_TENSOR} shards (one per trainer rank "
                    "holding it is the most a trainer sends)",
                    name=name,
                )
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
        _check_segments(shards)

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
            if size < 0 or offset < 0 or offset + size > full or (size == 0 and full > 0):
                raise ManifestError(
                    Kind.SHAPE,
                    f"{name}: block offset {list(shard.local_offset)} shape "
                    f"{list(shard.local_shape)} is empty or lies outside "
                    f"{list(shard.global_shape)}",
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
        nbytes = math.prod(shard.local_shape) * protocol.element_size(dtype)
        if storage == "shm":
            if tuple(shard.stride) != protocol.contiguous_strides(shard.local_shape):
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
            handle = shard.storage.shm
            if protocol.segment_creator(handle.name) is None:
                raise ManifestError(
                    Kind.STORAGE, f"{name}: {handle.name!r} is not a podrl segment", name=name
                )
            if handle.offset + handle.nbytes > handle.segment_nbytes:
                raise ManifestError(
                    Kind.SHAPE,
                    f"{name}: bytes {handle.offset}..{handle.offset + handle.nbytes} lie outside "
                    f"the segment's declared {handle.segment_nbytes} bytes (segment_nbytes)",
                    name=name,
                )
        elif storage == "cuda_ipc":
            span = sum((s - 1) * st for s, st in zip(shard.local_shape, shard.stride, strict=True))
            end = shard.storage.cuda_ipc.tensor_offset + (span + 1) * protocol.element_size(dtype)
            if nbytes and end > shard.storage.cuda_ipc.nbytes:
                raise ManifestError(
                    Kind.SHAPE, f"{name}: shard reaches past its CUDA storage", name=name
                )
        else:
            raise ManifestError(Kind.STORAGE, f"{name}: shard has no storage handle", name=name)

    # -- applying ----------------------------------------------------------------------------

    def start(
        self,
        manifest: weights_pb2.WeightManifest,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Validate, (re)plan and open the handles if the storage changed, check finiteness.

        ``destinations`` (name -> tensor in the layout's naming) are copied into in place;
        without them the receiver fills buffers of its own (allocated once per fingerprint).
        Nothing is written here: a :class:`ManifestError` leaves everything as it was.
        """
        started = time.perf_counter()
        self._started = None
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
        if self.check_finite:
            _require_finite(cached.finite)
        self._started = _Started(manifest.version, cached, reuse, started)

    def update(self) -> None:
        """Run the copy plan into the destinations; returns when every copy has finished."""
        started = self._require_started("update")
        # Cached before the copy: a copy that fails half-way leaves the plan valid (the next
        # update of this storage rewrites every destination).
        self._cached = started.cached
        started.cached.plan.run()
        started.copied = True

    def finish(self) -> CopiedWeights:
        """The filled tensors of the update that :meth:`update` copied."""
        started = self._require_started("finish")
        if not started.copied:
            raise RuntimeError("WeightReceiver.finish before update: nothing was copied")
        self._started = None
        cached = started.cached
        return CopiedWeights(
            version=started.version,
            plan_cached=started.reused,
            seconds=time.perf_counter() - started.started,
            tensors=[(name, cached.destinations[name]) for name in self.layout],
        )

    def _require_started(self, phase: str) -> _Started:
        if self._started is None:
            raise RuntimeError(f"WeightReceiver.{phase} without a started manifest (start)")
        return self._started

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
            protocol.from_wire(shard.dtype) for shard in manifest.shards
        }
        on_device = None
        if self.map_on_destination and len(gpus) == 1 and same_dtype:
            on_device = gpus.pop()
        sources = _open_sources(manifest.shards, on_device, self.segment_owner_uid)
        plan = CopyPlan.compile(sources, self.layout, destinations, streams=self.copy_streams)
        return _Cached(
            fingerprint=manifest.model_fingerprint,
            shards_bytes=_shards_bytes(manifest),
            sources=sources,
            plan=plan,
            finite=FiniteCheck(
                (name, shard.tensor) for name, shards in sources.items() for shard in shards
            ),
            destinations=destinations,
            owns_destinations=owns,
        )

    def close(self) -> None:
        """Drop mapped handles and buffers; unlink segments of trainers that are gone."""
        self._cached = None
        self._started = None
        protocol.reap_orphaned_segments()


def _shards_bytes(manifest: weights_pb2.WeightManifest) -> bytes:
    return b"".join(shard.SerializeToString(deterministic=True) for shard in manifest.shards)


def _check_tiling(
    name: str, global_shape: tuple[int, ...], shards: list[weights_pb2.TensorShard]
) -> None:
    """Distinct shard blocks (replicas dropped) must cover the global tensor exactly once.

    Every layout a DTensor has is a grid: per dimension, the blocks' intervals partition it,
    and each combination of one interval per dimension is one block. So the check is, per
    dimension, that the distinct intervals sorted end to end make up the dimension, and that
    the number of distinct blocks is the product of the interval counts (distinct blocks drawn
    from that product set, as many as it has: each cell once). Linear in the shards after a
    sort (comparing blocks pairwise was quadratic: 16,641 shards took minutes).
    """
    boxes = {protocol.shard_box(shard) for shard in shards}
    cells = 1
    problem = ""
    for dim, full in enumerate(global_shape):
        position = 0
        intervals = sorted({(box.offset[dim], box.shape[dim]) for box in boxes})
        for start, size in intervals:
            if start != position:
                problem = "overlap" if start < position else "leave a gap"
                break
            position = start + size
        if not problem and position != full:
            problem = "leave a gap"
        if problem:
            problem = f"blocks {problem} along dimension {dim}"
            break
        cells *= len(intervals)
    if not problem and len(boxes) != cells:
        problem = f"{len(boxes)} distinct blocks do not form the {cells} cells of a grid"
    if problem:
        raise ManifestError(
            Kind.COVERAGE,
            f"{name}: the shards do not tile {list(global_shape)} exactly once: {problem}",
            name=name,
        )


def _check_segments(shards: list[weights_pb2.TensorShard]) -> None:
    """Shards in one shared-memory segment agree on its size and never share bytes (the
    trainer packs each tensor of a rank into bytes of its own; overlapping views would read
    one tensor's data as another's)."""
    by_segment: dict[str, list[tuple[int, int, str]]] = {}
    sizes: dict[str, int] = {}
    for shard in shards:
        if shard.storage.WhichOneof("kind") != "shm":
            continue
        handle = shard.storage.shm
        if sizes.setdefault(handle.name, handle.segment_nbytes) != handle.segment_nbytes:
            raise ManifestError(
                Kind.SHAPE,
                f"{shard.name}: shards in {handle.name} disagree on segment_nbytes",
                name=shard.name,
            )
        by_segment.setdefault(handle.name, []).append(
            (handle.offset, handle.offset + handle.nbytes, shard.name)
        )
    for segment, ranges in by_segment.items():
        ranges.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
            if start < end:
                raise ManifestError(
                    Kind.SHAPE,
                    f"{second}: its bytes in {segment} overlap those of {first}",
                    name=second,
                )


def check_shard_count(manifest: weights_pb2.WeightManifest, parameters: int) -> None:
    """``LIMIT`` unless the manifest has at most ``MAX_SHARDS_PER_TENSOR`` shards per
    parameter of the model in all. The generator runs it on every manifest before its locks
    (``WeightApplier.apply``), so an oversized one never holds back a Generate; the receiver
    in the workers then sees only manifests that passed it."""
    cap = MAX_SHARDS_PER_TENSOR * max(parameters, 1)
    if len(manifest.shards) > cap:
        raise ManifestError(
            Kind.LIMIT,
            f"{len(manifest.shards)} shards for a model of {parameters} parameters; at most "
            f"{MAX_SHARDS_PER_TENSOR} per parameter ({cap}) are taken",
        )


def _require_finite(check: FiniteCheck) -> None:
    """``NON_FINITE`` unless every opened source element is finite (``FiniteCheck``)."""
    bad = check.first_non_finite()
    if bad is not None:
        raise ManifestError(
            Kind.NON_FINITE,
            f"{bad}: the published weights hold NaN or infinity; nothing was copied and the "
            "served weights stay",
            name=bad,
        )


def _open_sources(
    shards: list[weights_pb2.TensorShard],
    on_device: int | None = None,
    segment_owner_uid: int | None = None,
) -> dict[str, list[SourceShard]]:
    """Open every distinct shard once (replicas are skipped); STORAGE error if one fails.

    ``on_device``: the GPU to map CUDA IPC storage on (see :func:`cuda_ipc.open_storage`).
    """
    segments: dict[str, torch.Tensor] = {}
    sources: dict[str, list[SourceShard]] = {}
    seen: set[tuple[str, protocol.Box]] = set()
    for shard in shards:
        box = protocol.shard_box(shard)
        if (shard.name, box) in seen:
            continue
        seen.add((shard.name, box))
        dtype = protocol.from_wire(shard.dtype)
        assert dtype is not None  # validated
        try:
            tensor = _open_shard(shard, dtype, segments, on_device, segment_owner_uid)
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
    segment_owner_uid: int | None = None,
) -> torch.Tensor:
    shape = tuple(shard.local_shape)
    if shard.storage.WhichOneof("kind") == "shm":
        handle = shard.storage.shm
        if not protocol.creator_alive(handle.name):
            raise FileNotFoundError(
                f"the creator of {handle.name} is not running (or not visible: trainer and "
                "generator need one PID namespace, shareProcessNamespace: true)"
            )
        if handle.name not in segments:
            segments[handle.name] = protocol.open_segment_readonly(
                handle.name, nbytes=handle.segment_nbytes, owner_uid=segment_owner_uid
            )
        data = segments[handle.name]
        if handle.offset + handle.nbytes > data.numel():
            raise ValueError(f"{handle.name} is smaller than offset + nbytes")
        return data[handle.offset : handle.offset + handle.nbytes].view(dtype).view(shape)
    handle = shard.storage.cuda_ipc
    storage, index = cuda_ipc.open_storage(handle, on_device=on_device)
    element = protocol.element_size(dtype)
    tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    return tensor.set_(storage, handle.tensor_offset // element, shape, tuple(shard.stride))
