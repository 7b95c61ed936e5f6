"""Benchmark one trainer -> generator weight sync (ARCHITECTURE.md §4) on CPU or CUDA.

Two processes: this one plays the trainer (holds random Qwen3-shaped weights), a spawned one
plays the generator (vLLM's fused TP-1 layout: qkv_proj, gate_up_proj, in the target dtype).
One sync is timed from "version ready" on the trainer to the generator's acknowledgment.

  podrl       handles opened once, cached copy plan; a version-only manifest per step
  per_param   (a) one handle per parameter, created and opened each step
  buckets     (b) parameters packed into 1 GiB buckets, one handle per bucket, each step
  memcpy      (c) one flat copy of the same bytes in one process (the bound)

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
from pathlib import Path

import torch

from podrl.models.qwen3_shapes import QWEN3_SHAPES
from podrl.v1 import weights_pb2
from podrl.weights import ModelDescription, WeightReceiver, cuda_ipc, manifest, vllm_layout
from podrl.weights.dtypes import parse_dtype
from podrl.weights.publisher import ManifestAssembler, ShmStaging, WeightPublisher

BUCKET_BYTES = 1 << 30
MODES = ("podrl", "per_param", "buckets", "memcpy")


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


def generator_process(conn, shape: str, layers: int | None, dst_dtype: str, device: str) -> None:
    """The generator: applies what arrives (protobuf bytes) and acknowledges."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    description = describe(shape, layers)
    layout = vllm_layout(description, 0, 1)
    dtype = parse_dtype(dst_dtype)
    dst = {n: torch.empty(t.shape, dtype=dtype, device=device) for n, t in layout.items()}
    cached = WeightReceiver(description, layout=layout, device=device)
    while True:
        message = conn.recv_bytes()
        if message == b"quit":
            return
        mode, payload = message.split(b"|", 1)
        update = weights_pb2.WeightManifest.FromString(payload)
        if mode == b"podrl":
            cached.apply(update, dst)
        else:  # every step: a new receiver, handles opened and the plan compiled afresh
            fresh = WeightReceiver(description, layout=layout, device=device)
            fresh.apply(update, dst)
            del fresh
        conn.send_bytes(b"ack")


def run_shape(args: argparse.Namespace, shape: str, src: torch.dtype, dst: torch.dtype) -> dict:
    description = describe(shape, args.layers)
    numel = sum(math.prod(s) for s in description.params.values())
    src_bytes, dst_bytes = numel * src.itemsize, numel * dst.itemsize
    result = {"shape": shape, "layers": args.layers, "params": numel, "src_dtype": str(src),
              "dst_dtype": str(dst), "device": args.device, "src_bytes": src_bytes}  # fmt: skip
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
    params = make_params(description, src, args.device)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    dst_name = str(dst).removeprefix("torch.")
    proc = ctx.Process(
        target=generator_process, args=(child, shape, args.layers, dst_name, args.device)
    )
    proc.start()
    try:
        publisher = WeightPublisher(lambda: params)
        assembler = ManifestAssembler("bench")
        version = 0

        def sync(mode: str, make) -> float:
            nonlocal version
            version += 1
            keep: list = []
            started = time.perf_counter()
            update = make(version, keep)
            parent.send_bytes(mode.encode() + b"|" + update.SerializeToString())
            assert parent.recv_bytes() == b"ack"
            elapsed = time.perf_counter() - started
            for item in keep:
                if isinstance(item, ShmStaging):
                    item.close()
            return elapsed

        def podrl(v: int, keep: list) -> weights_pb2.WeightManifest:
            part = publisher.prepare(v)
            publisher.acknowledge(v)  # the ack of v-1 arrived before we got here
            return assembler.assemble(v, [part])

        makers = {
            "podrl": podrl,
            "per_param": lambda v, keep: per_step_manifest(params, v, None, keep),
            "buckets": lambda v, keep: per_step_manifest(params, v, BUCKET_BYTES, keep),
        }
        for mode, make in makers.items():
            times = [sync(mode, make) for _ in range(args.warmup + args.reps)][args.warmup :]
            result[mode + "_ms"] = 1e3 * statistics.median(times)
        flat_src = torch.empty(numel, dtype=src, device=args.device)
        flat_dst = torch.empty(numel, dtype=dst, device=args.device)
        times = []
        for _ in range(args.warmup + args.reps):
            started = time.perf_counter()
            flat_dst.copy_(flat_src)
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
        result["memcpy_ms"] = 1e3 * statistics.median(times[args.warmup :])
        publisher.close()
    finally:
        params = flat_src = flat_dst = None
        if args.device == "cuda":
            torch.cuda.empty_cache()
        parent.send_bytes(b"quit")
        proc.join(timeout=120)
    return result


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
    parser.add_argument("--layers", type=int, default=None, help="cut decoder layers (CPU runs)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    shapes = [s.strip().lower() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in QWEN3_SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; choose from {sorted(QWEN3_SHAPES)}")
    pairs = []
    for spec in args.dtype.split(","):
        src, _, dst = spec.partition("->")
        pairs.append((parse_dtype(src.strip()), parse_dtype((dst or src).strip())))
    results = [run_shape(args, shape, s, d) for shape in shapes for s, d in pairs]
    header = f"{'shape':<6} {'dtypes':<18} {'GiB':>6} " + " ".join(
        f"{m + ' ms':>13}" for m in MODES
    )
    print(header)
    for r in results:
        dtypes = f"{r['src_dtype'][6:]}->{r['dst_dtype'][6:]}"
        if "skipped" in r:
            print(f"{r['shape']:<6} {dtypes:<18} skipped: {r['skipped']}")
            continue
        cells = " ".join(f"{r[m + '_ms']:>13.2f}" for m in MODES)
        print(f"{r['shape']:<6} {dtypes:<18} {r['src_bytes'] / 2**30:>6.2f} {cells}")
    if args.out:
        args.out.write_text(json.dumps({"settings": _settings(args), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
