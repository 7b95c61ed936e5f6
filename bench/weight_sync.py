"""Benchmark one trainer -> generator weight sync (docs/architecture.md, "Weights") on CPU or CUDA.

Two processes: this one plays the trainer (holds random Qwen3-shaped weights), a spawned one
plays the generator (vLLM's fused TP-1 layout: qkv_proj, gate_up_proj, in the target dtype).
One sync is timed from "version ready" on the trainer to the generator's acknowledgment, over a
``multiprocessing`` Pipe. Not included: the gRPC hops (controller -> trainer PublishWeights,
controller -> generator ApplyWeights, the acknowledgment), the trainer's rank-command
broadcast/gather, vLLM itself (``collective_rpc`` into its workers, its reload path) and any
contention with inference; the end-to-end sync through the services is measured separately.

  podrl       handles opened once, cached copy plan; a version-only manifest per step
  per_param   (a) one handle per parameter, created and opened each step, every tensor copied
              into the fused layout (vLLM's IPC weight-transfer engine, unpacked mode)
  buckets     (b) verl's bucketed transfer: parameters packed back to back into one reused
              bucket buffer, one reply per bucket (see BucketSender)
  memcpy      (c) one flat copy of the same bytes in one process (the bound)

The baselines run as their implementations do: one receiver for the process's life, tensors
copied eagerly (no CUDA graph), no plan kept from one sync to the next; only podrl caches.

Before/after in one run: every shape runs twice, each time with its own generator process.
``legacy`` is the previous podrl path (full storage walk on publish, peer sources mapped on their
own GPU, a one-stream CUDA graph); ``new`` the current one (cached storage check, peer sources
mapped on the generator's GPU, a graph forked over several streams). ``--variants`` picks.

On CPU every handle is a POSIX shared-memory segment and the trainer copies into it (the CPU
publisher's staging copy); on CUDA podrl exports the parameters themselves by CUDA IPC.

  python bench/weight_sync.py --device cpu --shapes 0.6b --layers 2 --reps 3 --out r.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Mapping
from functools import partial
from pathlib import Path

import torch

from podrl.models.qwen3_shapes import QWEN3_SHAPES
from podrl.v1 import weights_pb2
from podrl.weights import (
    ModelDescription,
    WeightReceiver,
    cuda_ipc,
    protocol,
    vllm_layout,
)
from podrl.weights.protocol import element_size, from_wire, parse_dtype
from podrl.weights.publisher import ManifestAssembler, ShmStaging, WeightPublisher
from podrl.weights.receiver import (
    DEFAULT_COPY_STREAMS,
    CopyPlan,
    SourceShard,
    TargetLayout,
    TargetTensor,
)

# verl's default bucket: CheckpointEngineConfig.update_weights_bucket_megabytes = 2048
# (verl/workers/config/rollout.py, verl-project/verl, formerly volcengine/verl).
BUCKET_MIB = 2048
MODES = ("podrl", "per_param", "buckets", "memcpy")
COPY_VARIANTS = ("foreach_devsync", "loop_event", "plan")
VARIANTS = ("legacy", "new")


def describe(shape: str, layers: int | None) -> ModelDescription:
    config = dict(QWEN3_SHAPES[shape], architectures=["Qwen3ForCausalLM"])
    if layers:
        config["num_hidden_layers"] = layers
    return ModelDescription.from_hf_config(config)


def make_params(description: ModelDescription, dtype: torch.dtype, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        name: torch.empty(shape, dtype=dtype, device=device).uniform_(-0.05, 0.05, generator=gen)
        for name, shape in description.params.items()
    }


def per_param_manifest(params: dict, version: int, keep: list) -> weights_pb2.WeightManifest:
    """(a): fresh handles this step, one per parameter, all in one message.

    What vLLM's IPC weight-transfer engine ships per update in its unpacked mode
    (``vllm/distributed/weight_transfer/ipc_engine.py``: ``reduce_tensor`` per parameter on the
    trainer, ``rebuild_cuda_tensor`` + ``model.load_weights`` on the worker). On CPU each
    parameter gets its own shared-memory segment, created and filled this step.
    """
    local = protocol.local_shards(params)
    if next(iter(params.values())).is_cuda:
        shards = [
            s.to_wire(weights_pb2.TensorStorage(cuda_ipc=cuda_ipc.export_tensor(s.tensor)), 0)
            for s in local
        ]
        torch.cuda.synchronize()
    else:
        staging = ShmStaging(local, 1)  # 1 byte: a segment per parameter
        staging.refresh(local)
        keep.append(staging)
        shards = [s.to_wire(h, 0) for s, h in zip(local, staging.handles, strict=True)]
    return weights_pb2.WeightManifest(
        version=version, model_fingerprint=f"step-{version}", shards=shards, publisher_id="bench"
    )


class BucketSender:
    """(b), the trainer side: verl's bucketed weight transfer, as verl runs it.

    After ``BucketedWeightSender.async_send_weights`` in verl-project/verl (formerly
    volcengine/verl) ``verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py``, commit
    018aa20d: per sync it allocates **one** bucket buffer and shares its handle, packs the
    parameters into it back to back (no alignment) in order, and when the next parameter does
    not fit it synchronizes, sends that bucket's metadata and waits for the receiver's reply
    before it packs the next bucket into the same buffer. After the last bucket it frees the
    buffer (``gc.collect``, ``ipc_collect``, ``empty_cache``). verl refuses a parameter larger
    than the bucket (raise ``update_weights_bucket_megabytes``); here the bucket grows to the
    largest parameter instead, and the size used is recorded. verl's extra round trip that
    shares the buffer handle before the first bucket is left out (one pipe message, ~0.1 ms):
    the handle travels with every bucket and the receiver opens it once per sync.
    """

    def __init__(self, params: dict, bucket_bytes: int) -> None:
        self.local = protocol.local_shards(params)
        self.cuda = self.local[0].tensor.is_cuda
        largest = max(s.tensor.numel() * s.tensor.element_size() for s in self.local)
        self.bucket_bytes = max(bucket_bytes, largest)
        self.buckets = 0
        self.cleanup_seconds = 0.0  # verl's end-of-sync cleanup on this side, last sync
        self.last_reply: dict = {}  # the generator's stamps after the last bucket

    def sync(self, conn, version: int) -> None:
        """Send every parameter, bucket by bucket; returns after the last bucket's reply."""
        if self.cuda:
            device = self.local[0].tensor.device
            buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8, device=device)
            base: weights_pb2.CudaIpcHandle | protocol.SharedSegment = cuda_ipc.export_tensor(
                buffer
            )
        else:
            base = protocol.SharedSegment(self.bucket_bytes)
            buffer = base.data
        try:
            entries: list[weights_pb2.TensorShard] = []
            offset, self.buckets = 0, 0
            for shard in self.local:
                nbytes = shard.tensor.numel() * shard.tensor.element_size()
                if entries and offset + nbytes > self.bucket_bytes:
                    self._send(conn, version, entries, last=False)
                    entries, offset = [], 0
                flat = shard.tensor.reshape(-1).view(torch.uint8)
                buffer[offset : offset + nbytes].copy_(flat, non_blocking=True)
                entries.append(shard.to_wire(self._storage(base, offset, nbytes), 0))
                offset += nbytes
            self._send(conn, version, entries, last=True)
        finally:
            started = time.perf_counter()
            del buffer
            if isinstance(base, protocol.SharedSegment):
                base.unlink()
            gc.collect()
            if self.cuda:
                torch.cuda.ipc_collect()
                torch.cuda.empty_cache()
            self.cleanup_seconds = time.perf_counter() - started

    @staticmethod
    def _storage(base, offset: int, nbytes: int) -> weights_pb2.TensorStorage:
        if isinstance(base, protocol.SharedSegment):
            return weights_pb2.TensorStorage(
                shm=weights_pb2.ShmHandle(name=base.name, offset=offset, nbytes=nbytes)
            )
        handle = weights_pb2.CudaIpcHandle()
        handle.CopyFrom(base)
        handle.tensor_offset = offset
        return weights_pb2.TensorStorage(cuda_ipc=handle)

    def _send(self, conn, version: int, entries: list, *, last: bool) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # the packing copies are done before the receiver reads
        bucket = weights_pb2.WeightManifest(version=version, shards=entries, publisher_id="bench")
        conn.send_bytes((b"bucket_last|" if last else b"bucket|") + bucket.SerializeToString())
        reply = conn.recv_bytes()
        self.buckets += 1
        if last:
            self.last_reply = json.loads(reply)


class BaselineReceiver:
    """The generator side of both baselines: one object for the process's life.

    Each message lists tensors by HF name with a storage handle. ``load`` opens the handles
    (each once per sync, mapped on the destination GPU as vLLM's ``rebuild_cuda_tensor`` and
    verl's ``rebuild_ipc`` do), clones the tensors first where verl does (a CUDA bucket, so the
    buffer can be reused), and copies every tensor into its slices of vLLM's fused layout, what
    ``model.load_weights`` does: eagerly, one ``copy_`` per slice, no CUDA graph, nothing kept
    for the next sync.
    """

    def __init__(self, layout: TargetLayout, destinations: dict[str, torch.Tensor]) -> None:
        self.destinations = destinations
        gpus = {t.device.index for t in destinations.values() if t.is_cuda}
        self.on_device = gpus.pop() if len(gpus) == 1 else None
        self.targets_of: dict[str, dict[str, TargetTensor]] = defaultdict(dict)
        for target in layout.values():
            for piece in target.pieces:
                self.targets_of[piece.hf_name][target.name] = target
        self._opened: dict[str | tuple[bytes, int], object] = {}

    def _open(self, shard: weights_pb2.TensorShard) -> torch.Tensor:
        dtype = from_wire(shard.dtype)
        shape = tuple(shard.local_shape)
        if shard.storage.WhichOneof("kind") == "shm":
            handle = shard.storage.shm
            if handle.name not in self._opened:
                self._opened[handle.name] = protocol.open_segment_readonly(handle.name)
            data = self._opened[handle.name]
            return data[handle.offset : handle.offset + handle.nbytes].view(dtype).view(shape)
        handle = shard.storage.cuda_ipc
        # One CUDA allocation can hold several storages (torch's caching allocator carves them
        # out of one segment): a storage is its segment's handle plus its offset in it.
        key = (handle.handle, handle.offset)
        if key not in self._opened:
            self._opened[key] = cuda_ipc.open_storage(handle, on_device=self.on_device)
        storage, index = self._opened[key]
        tensor = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
        offset = handle.tensor_offset // element_size(dtype)
        return tensor.set_(storage, offset, shape, tuple(shard.stride))

    def load(self, shards, *, clone: bool) -> CopyPlan:
        """Open (and clone) this message's tensors; the returned plan copies them when run."""
        sources: dict[str, list[SourceShard]] = defaultdict(list)
        targets: dict[str, TargetTensor] = {}
        for shard in shards:
            tensor = self._open(shard)
            if clone:
                tensor = tensor.clone()
            sources[shard.name].append(SourceShard(protocol.shard_box(shard), tensor))
            targets.update(self.targets_of[shard.name])
        if clone:
            torch.cuda.synchronize()
        # A fused target whose other parts travel in another bucket gets no ops from this one.
        return CopyPlan.compile(sources, targets, self.destinations, use_graph=False)

    def receive_bucket(
        self, conn, bucket: weights_pb2.WeightManifest, *, last: bool, clone: bool
    ) -> float:
        """One bucket of a :class:`BucketSender` sync, loaded into the destinations.

        A bucket before the last is answered here: verl replies once it has cloned the bucket
        (the sender then refills the buffer) and loads afterwards; without a clone (shared
        memory, which ``tensor.to(cpu)`` does not copy) it must load before it replies. After
        the last bucket the caller answers, once everything is loaded. Returns the seconds of
        verl's end-of-sync cleanup (after the last bucket; 0 before it).
        """
        plan = self.load(bucket.shards, clone=clone)
        if not last and clone:
            conn.send_bytes(b"{}")
        plan.run()
        if not last and not clone:
            conn.send_bytes(b"{}")
        return self.end_sync(verl_cleanup=True) if last else 0.0

    def end_sync(self, *, verl_cleanup: bool) -> float:
        """Drop this sync's mappings (verl's receiver also collects and empties the cache);
        returns the seconds it took."""
        started = time.perf_counter()
        self._opened.clear()
        if verl_cleanup:
            gc.collect()
            if self.on_device is not None:
                torch.cuda.ipc_collect()
                torch.cuda.empty_cache()
        return time.perf_counter() - started


def _run_variant(plan, variant: str) -> None:
    """The copy of a cached plan, three ways (measured against each other in one run)."""
    with torch.no_grad():
        if variant == "foreach_devsync":  # the previous plan: multi-tensor copy, device sync
            groups: dict[tuple, tuple[list, list]] = {}
            for op in plan.ops:
                key = (op.src.device, op.src.dtype, op.dst.device, op.dst.dtype)
                groups.setdefault(key, ([], []))
                groups[key][0].append(op.dst)
                groups[key][1].append(op.src)
            for dsts, srcs in groups.values():
                torch._foreach_copy_(dsts, srcs)
            for index in plan._cuda_devices:
                torch.cuda.synchronize(index)
            return
        if variant == "loop_event":  # one copy_ per slice, then an event per device
            for op in plan.ops:
                op.dst.copy_(op.src, non_blocking=True)
        else:  # "plan": what apply() runs (one CUDA graph on one GPU, else the loop)
            plan.launch()
    plan.wait()


class FullWalkPublisher(WeightPublisher):
    """The legacy variant's publisher: every publish walks every parameter's storage (the
    path before the cached storage snapshot)."""

    def _same_storage(self, params: Mapping[str, torch.Tensor]) -> bool:
        return False


def receiver_options(variant: str) -> dict:
    """WeightReceiver options of a variant: the previous copy path or the current one."""
    if variant == "legacy":
        return {"copy_streams": 1, "map_on_destination": False}
    return {"copy_streams": DEFAULT_COPY_STREAMS, "map_on_destination": True}


def generator_process(
    conn, shape: str, layers: int | None, dst_dtype: str, device: str, variant: str
) -> None:
    """The generator: applies what arrives (protobuf bytes) and acknowledges.

    The ack carries its timestamps (perf_counter: CLOCK_MONOTONIC, comparable across processes
    on one host) so the trainer can split a sync into stages.
    """
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # like a vLLM worker on its own GPU
    description = describe(shape, layers)
    layout = vllm_layout(description, 0, 1)
    dtype = parse_dtype(dst_dtype)
    dst = {n: torch.zeros(t.shape, dtype=dtype, device=device) for n, t in layout.items()}
    options = receiver_options(variant)
    cached = WeightReceiver(description, layout=layout, device=device, **options)
    baseline = BaselineReceiver(layout, dst)
    while True:
        message = conn.recv_bytes()
        received = time.perf_counter()
        if message == b"quit":
            return
        mode, payload = message.split(b"|", 1)
        update = weights_pb2.WeightManifest.FromString(payload)
        stamps = {"received": received, "parsed": time.perf_counter()}
        if mode == b"podrl":
            cached.apply(update, dst)
        elif mode.startswith(b"staged:"):
            # The steps of apply() one by one, timed; the copy done one of three ways.
            cached.validate(update)
            plan = cached._cached.plan
            stamps["validated"] = time.perf_counter()
            _run_variant(plan, mode.split(b":", 1)[1].decode())
            cached.version = update.version
        elif mode == b"per_param":  # every handle opened, every tensor copied, then dropped
            baseline.load(update.shards, clone=False).run()
            baseline.end_sync(verl_cleanup=False)
        else:  # b"bucket" / b"bucket_last": verl's BucketedWeightReceiver + load_weights
            last = mode == b"bucket_last"
            clone = device.startswith("cuda")
            cleanup = baseline.receive_bucket(conn, update, last=last, clone=clone)
            if not last:
                continue  # receive_bucket replied
            stamps["cleanup"] = cleanup
        stamps["copied"] = time.perf_counter()
        if cached._cached is not None:  # what the cached plan turned into (for the record)
            plan = cached._cached.plan
            stamps["plan_graph"] = plan.uses_graph
            stamps["plan_devices"] = sorted({str(op.src.device) for op in plan.ops})
        conn.send_bytes(json.dumps(stamps).encode())


def run_shape(
    args: argparse.Namespace, shape: str, src: torch.dtype, dst: torch.dtype, placement: str
) -> dict:
    description = describe(shape, args.layers)
    numel = sum(math.prod(s) for s in description.params.values())
    src_bytes, dst_bytes = numel * src.itemsize, numel * dst.itemsize
    cuda = args.device == "cuda"
    result = {"shape": shape, "placement": placement, "layers": args.layers, "params": numel,
              "src_dtype": str(src), "dst_dtype": str(dst), "device": args.device,
              "src_bytes": src_bytes}  # fmt: skip
    if args.device == "cpu":
        # source + staging + per-step copy (trainer), destination (generator), some slack
        import psutil  # dev dependency; only the CPU check needs it

        need, have = 3 * src_bytes + 2 * dst_bytes, psutil.virtual_memory().available
    else:
        # params + (buckets | flat copy) here, the destination in the generator process
        need, have = 2 * src_bytes + 2 * dst_bytes, torch.cuda.mem_get_info()[0]
    if need > have:
        result["skipped"] = f"needs ~{need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB available"
        print(f"skip {shape} {src}->{dst}: {result['skipped']}", file=sys.stderr)
        return result
    src_device, dst_device = "cuda:0" if cuda else "cpu", "cpu"
    if cuda:
        dst_device = "cuda:1" if placement == "peer" else "cuda:0"
    result["src_device"], result["dst_device"] = src_device, dst_device
    params = make_params(description, src, src_device)
    try:
        for variant in args.variants:
            _run_variant_phase(args, shape, dst, dst_device, params, variant, result)
        flat_src = torch.empty(numel, dtype=src, device=src_device)
        flat_dst = torch.empty(numel, dtype=dst, device=dst_device)
        times = []
        for _ in range(args.warmup + args.reps):
            started = time.perf_counter()
            flat_dst.copy_(flat_src)
            if cuda:
                torch.cuda.synchronize(src_device)
                torch.cuda.synchronize(dst_device)
            times.append(time.perf_counter() - started)
        result["memcpy_ms"] = 1e3 * statistics.median(times[args.warmup :])
        for prefix in ("", "legacy_"):
            if f"{prefix}podrl_ms" not in result:
                continue
            result[f"{prefix}podrl_over_memcpy"] = result[f"{prefix}podrl_ms"] / result["memcpy_ms"]
            staged = result.get(f"{prefix}staged_plan_stages_ms")
            if cuda and staged:
                result[f"{prefix}copy_over_memcpy"] = staged["copy"] / result["memcpy_ms"]
            for baseline in ("buckets", "per_param"):
                if f"{baseline}_ms" in result:
                    result[f"{baseline}_over_{prefix}podrl"] = (
                        result[f"{baseline}_ms"] / result[f"{prefix}podrl_ms"]
                    )
    finally:
        params = flat_src = flat_dst = None
        if cuda:
            torch.cuda.empty_cache()
    return result


def _run_variant_phase(
    args: argparse.Namespace,
    shape: str,
    dst: torch.dtype,
    dst_device: str,
    params: dict,
    variant: str,
    result: dict,
) -> None:
    """One generator process with ``variant``'s receiver; results keyed ``legacy_*`` or plain.

    A process per variant: torch maps a CUDA IPC handle once per process, on the device it was
    first opened on, so the two ways of mapping peer sources cannot share one process.
    """
    cuda = args.device == "cuda"
    prefix = "legacy_" if variant == "legacy" else ""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    dst_name = str(dst).removeprefix("torch.")
    proc = ctx.Process(
        target=generator_process,
        args=(child, shape, args.layers, dst_name, dst_device, variant),
    )
    proc.start()
    try:
        publisher = (FullWalkPublisher if variant == "legacy" else WeightPublisher)(lambda: params)
        assembler = ManifestAssembler("bench")
        version = 0
        info: dict = {}

        def sync(mode: str, make) -> dict[str, float]:
            """One sync; its stages in ms (ready -> manifest -> parsed -> copied -> acked)."""
            nonlocal version
            version += 1
            keep: list = []
            started = time.perf_counter()
            update = make(version, keep)
            message = mode.encode() + b"|" + update.SerializeToString()
            published = time.perf_counter()
            parent.send_bytes(message)
            stamps = json.loads(parent.recv_bytes())
            acked = time.perf_counter()
            for item in keep:
                if isinstance(item, ShmStaging):
                    item.close()
            if mode == "podrl":
                info.update({k: stamps[k] for k in ("plan_graph", "plan_devices") if k in stamps})
            stages = {
                "total": acked - started,
                "publish": published - started,
                "control_in": stamps["parsed"] - published,
                "ack": acked - stamps["copied"],
            }
            if "validated" in stamps:  # staged: validate, then the copy (launch + wait)
                stages["validate"] = stamps["validated"] - stamps["parsed"]
                stages["copy"] = stamps["copied"] - stamps["validated"]
            else:  # receiver.apply() as a whole (validate, run the cached plan, wait)
                stages["apply"] = stamps["copied"] - stamps["parsed"]
            return stages

        def podrl(v: int, keep: list) -> weights_pb2.WeightManifest:
            part = publisher.start(v)
            publisher.finish(v)  # the ack of v-1 arrived before we got here
            return assembler.assemble(v, [part])

        runs = [("podrl", "podrl", podrl)]
        baselines = variant != "legacy" or args.variants == ["legacy"]  # once per shape
        if baselines:
            runs.append(("per_param", "per_param", partial(per_param_manifest, params)))
        if cuda:  # the podrl sync again, apply() taken apart to time the copy variants
            variants = COPY_VARIANTS if variant == "legacy" else ("plan",)
            runs += [(f"staged_{v}", f"staged:{v}", podrl) for v in variants]
        for label, mode, make in runs:
            samples = [sync(mode, make) for _ in range(args.warmup + args.reps)][args.warmup :]
            key = label if label in ("per_param", "buckets") else prefix + label
            result[key + "_ms"] = 1e3 * statistics.median(s["total"] for s in samples)
            if label == "podrl" or label.startswith("staged_"):
                result[key + "_stages_ms"] = {
                    k: 1e3 * statistics.median(s[k] for s in samples) for k in samples[0]
                }
        if baselines:
            sender = BucketSender(params, args.bucket_mib << 20)
            stages = []
            for _ in range(args.warmup + args.reps):
                version += 1
                started = time.perf_counter()
                sender.sync(parent, version)
                stages.append(
                    {
                        "total": time.perf_counter() - started,
                        "trainer_cleanup": sender.cleanup_seconds,
                        "generator_cleanup": sender.last_reply["cleanup"],
                    }
                )
            stages = stages[args.warmup :]
            result["buckets_ms"] = 1e3 * statistics.median(s["total"] for s in stages)
            result["buckets_stages_ms"] = {
                k: 1e3 * statistics.median(s[k] for s in stages) for k in stages[0]
            }
            result["bucket_bytes"], result["buckets_per_sync"] = sender.bucket_bytes, sender.buckets
        result[prefix + "plan"] = info
        publisher.close()
    finally:
        parent.send_bytes(b"quit")
        proc.join(timeout=120)


def _settings(args: argparse.Namespace) -> dict:
    """The run's options without file paths (results are committed; paths are machine-local)."""
    return {k: v for k, v in vars(args).items() if not isinstance(v, Path) and k != "out"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", default="0.6b", help="comma list of 0.6b,1.7b,8b")
    parser.add_argument(
        "--dtype", default="bf16", help="bf16 (bf16->bf16), fp32->bf16, or a comma list"
    )
    parser.add_argument(
        "--placements",
        default="same",
        help="CUDA: same (generator on the trainer's GPU), peer (GPU0 -> GPU1), or both",
    )
    parser.add_argument(
        "--variants",
        default="legacy,new",
        help="legacy (the previous sync path), new (the current one), or both (before/after)",
    )
    parser.add_argument("--layers", type=int, default=None, help="cut decoder layers (CPU runs)")
    parser.add_argument(
        "--bucket-mib",
        type=int,
        default=BUCKET_MIB,
        help="bucket size of the buckets baseline (verl's update_weights_bucket_megabytes)",
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: bench
    from bench import results_table

    stamp = results_table.stamp()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not args.variants or any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants: choose from {VARIANTS}, comma-separated")
    shapes = [s.strip().lower() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in QWEN3_SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {sorted(QWEN3_SHAPES)}")
    pairs = []
    for spec in args.dtype.split(","):
        src, _, dst = spec.partition("->")
        pairs.append((parse_dtype(src.strip()), parse_dtype((dst or src).strip())))
    placements = [p.strip() for p in args.placements.split(",") if p.strip()]
    if args.device == "cpu":
        placements = ["same"]
    elif "peer" in placements and torch.cuda.device_count() < 2:
        parser.error("--placements peer: needs two visible GPUs")
    results = []
    for placement in placements:
        for shape in shapes:
            for s, d in pairs:
                results.append(run_shape(args, shape, s, d, placement))
                if args.out:  # after every row: a run cut short still leaves its rows
                    out = {**stamp, "settings": _settings(args), "results": results}
                    args.out.write_text(json.dumps(out, indent=2))
    modes = ("legacy_podrl", *MODES)
    header = f"{'where':<5} {'shape':<6} {'dtypes':<18} {'GiB':>6} " + " ".join(
        f"{m + ' ms':>17}" for m in modes
    )
    print(header)
    for r in results:
        dtypes = f"{r['src_dtype'][6:]}->{r['dst_dtype'][6:]}"
        if "skipped" in r:
            print(f"{r['placement']:<5} {r['shape']:<6} {dtypes:<18} skipped: {r['skipped']}")
            continue
        cells = " ".join(f"{r.get(m + '_ms', math.nan):>17.2f}" for m in modes)
        gib = r["src_bytes"] / 2**30
        print(f"{r['placement']:<5} {r['shape']:<6} {dtypes:<18} {gib:>6.2f} {cells}")
        for key in sorted(k for k in r if k.endswith("_stages_ms")):
            stages = "  ".join(f"{k} {v:.2f}" for k, v in r[key].items())
            print(f"      {key.removesuffix('_stages_ms'):<30} {stages}")
    if args.out:
        out = {**stamp, "settings": _settings(args), "results": results}
        args.out.write_text(json.dumps(out, indent=2))
        results_table.update("weight_sync", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
