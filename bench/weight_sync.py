"""Benchmark one trainer -> generator weight sync (ARCHITECTURE.md §4) on CPU or CUDA.

Two processes: this one plays the trainer (holds random Qwen3-shaped weights), a spawned one
plays the generator (vLLM's fused TP-1 layout: qkv_proj, gate_up_proj, in the target dtype).
One sync is timed from "version ready" on the trainer to the generator's acknowledgment.

  podrl       handles opened once, cached copy plan; a version-only manifest per step
  per_param   (a) one handle per parameter, created and opened each step
  buckets     (b) parameters packed into 1 GiB buckets, one handle per bucket, each step
  memcpy      (c) one flat copy of the same bytes in one process (the bound)

Before/after in one run: every shape runs twice, each time with its own generator process.
``legacy`` is the previous path (full storage walk on publish, peer sources mapped on their own
GPU, a one-stream CUDA graph); ``new`` the current one (cached storage check, peer sources
mapped on the generator's GPU, a graph forked over several streams). ``--variants`` picks.

On CPU every handle is a POSIX shared-memory segment and the trainer copies into it (the CPU
publisher's staging copy); on CUDA podrl exports the parameters themselves by CUDA IPC.

  python bench/weight_sync.py --device cpu --shapes 0.6b --layers 2 --reps 3 --out r.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch

from podrl.models.qwen3_shapes import QWEN3_SHAPES
from podrl.v1 import weights_pb2
from podrl.weights import ModelDescription, WeightReceiver, cuda_ipc, manifest, vllm_layout
from podrl.weights.dtypes import parse_dtype
from podrl.weights.plan import DEFAULT_COPY_STREAMS
from podrl.weights.publisher import ManifestAssembler, ShmStaging, WeightPublisher

BUCKET_BYTES = 1 << 30
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


def per_step_manifest(
    params: dict, version: int, bucket_bytes: int | None, keep: list
) -> weights_pb2.WeightManifest:
    """(a)/(b): fresh handles this step (one per parameter, or one per bucket)."""
    local = manifest.local_shards(params)
    shards = []
    first = next(iter(params.values()))
    if first.is_cuda:
        if bucket_bytes is None:
            tensors = [s.tensor for s in local]
        else:
            tensors = _pack_cuda(local, bucket_bytes, keep)
        for shard, tensor in zip(local, tensors, strict=True):
            storage = weights_pb2.TensorStorage(cuda_ipc=cuda_ipc.export_tensor(tensor))
            shards.append(shard.to_wire(storage, 0))
        torch.cuda.synchronize()
    else:
        staging = ShmStaging(local, bucket_bytes or 1)  # 1 byte: a segment per parameter
        staging.refresh(local)
        keep.append(staging)
        shards = [s.to_wire(h, 0) for s, h in zip(local, staging.handles, strict=True)]
    return weights_pb2.WeightManifest(
        version=version, model_fingerprint=f"step-{version}", shards=shards, publisher_id="bench"
    )


def _pack_cuda(local: list, bucket_bytes: int, keep: list) -> list[torch.Tensor]:
    views, bucket, used = [], None, 0
    for shard in local:
        nbytes = shard.tensor.numel() * shard.tensor.element_size()
        if bucket is None or used + nbytes > bucket.numel():
            bucket = torch.empty(max(bucket_bytes, nbytes), dtype=torch.uint8, device="cuda")
            keep.append(bucket)
            used = 0
        view = bucket[used : used + nbytes].view(shard.tensor.dtype).view(shard.tensor.shape)
        view.copy_(shard.tensor)
        views.append(view)
        used += -(-nbytes // 256) * 256
    return views


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


def _per_step(
    version: int, keep: list, *, params: dict, bucket_bytes: int | None
) -> weights_pb2.WeightManifest:
    return per_step_manifest(params, version, bucket_bytes, keep)


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
        else:  # every step: a new receiver, handles opened and the plan compiled afresh
            fresh = WeightReceiver(description, layout=layout, device=device, **options)
            fresh.apply(update, dst)
            del fresh
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
        publisher = WeightPublisher(lambda: params, fast_storage_check=variant != "legacy")
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
            part = publisher.prepare(v)
            publisher.acknowledge(v)  # the ack of v-1 arrived before we got here
            return assembler.assemble(v, [part])

        runs = [("podrl", "podrl", podrl)]
        if variant != "legacy" or args.variants == ["legacy"]:  # baselines once per shape
            for label, bucket_bytes in (("per_param", None), ("buckets", BUCKET_BYTES)):
                make = partial(_per_step, params=params, bucket_bytes=bucket_bytes)
                runs.append((label, label, make))
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
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
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
                    out = {"settings": _settings(args), "results": results}
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
        args.out.write_text(json.dumps({"settings": _settings(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
