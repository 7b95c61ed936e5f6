"""Where the trainer's time per step goes: the real ``TrainerEngine.train_step`` on synthetic
GRPO batches, phase by phase.

Workloads (the shapes of bench/vs_trl_gpu.py's speed mode, synthetic token ids):

* ``A``: 16 prompts x 8 samples, prompts of 5-9 tokens, completions of 1-6 tokens (the copy
  task's step: almost nothing to compute, so the step is its fixed cost);
* ``B``: 64 prompts x 8 samples, prompts of 16-48 tokens, completions of 128-256 tokens.

Each step draws new lengths (fixed seed), so packed lengths vary as in a run. Per workload and
variant, three passes over the same steps:

1. **timed**: ``--steps`` steps after ``--warmup``, nothing added to the engine; the wall time
   of each step (device synchronised at its end), median/p90/max, and per step what may explain
   a spike (graphs compiled, device allocations, a garbage collection, the batch's size);
2. **phases**: the same steps again with the engine's parts wrapped (collate, copy to the
   device, forward, loss, backward, gradient norm and clip, the finiteness check, snapshot for
   the update size, optimizer, update size, zero_grad, agreement; the metric sums and the host
   read fall in "other"); on CUDA every part synchronises
   the device at its ends, so each part's time includes its kernels. Exclusive times
   (a part's children are subtracted), medians per part, and "other" = the step less the parts;
3. **profile**: one step under ``torch.profiler``: host synchronisations (on CUDA), FSDP's CPU
   ranges and the top ops.

Every step over twice the timed median gets one explanation line. ``--variants`` picks the
engines: ``after`` = the defaults, ``before`` = ``trainer.fsdp: always`` (FSDP2 over the one
rank, the path before a one-rank trainer trained the plain module); the other fixed-cost changes
(one host read per step instead of one per figure) cannot be turned off, so ``before`` measures
the FSDP part only.

  python -m bench.train_step_profile --device cpu --shape tiny --steps 10     # rehearsal
  python -m bench.train_step_profile --device cuda --shape 0.6b --variants before,after \\
      --out bench/results/train_step_profile_h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]

WORKLOADS: dict[str, dict[str, Any]] = {
    "A": {"prompts": 16, "group": 8, "prompt_tokens": (5, 9), "completion_tokens": (1, 6)},
    "B": {"prompts": 64, "group": 8, "prompt_tokens": (16, 48), "completion_tokens": (128, 256)},
}
VARIANTS = {"after": {}, "before": {"fsdp": "always"}}
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)


# -- model, engine and batches -------------------------------------------------------------------


def model_shape(shape: str) -> dict[str, Any]:
    if shape == "tiny":
        return dict(TINY)
    from podrl.models.qwen3_shapes import QWEN3_SHAPES

    return dict(QWEN3_SHAPES[shape])


def write_model(shape: str, out: Path, device: str) -> None:
    """A Qwen3 folder with random weights of ``shape`` (nothing downloaded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**model_shape(shape), max_position_embeddings=4096, pad_token_id=0)
    with torch.device(device):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(torch.bfloat16 if device == "cuda" else torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def build_engine(model: Path, device: str, args: argparse.Namespace, trainer: dict[str, Any]):
    from podrl.config import load_config
    from podrl.trainer.engine import TrainerEngine

    env = {
        "PODRL_DEVICE": device,
        "PODRL_RUN_DIR": tempfile.mkdtemp(prefix="podrl-profile-"),
        "PODRL_TRAINER__MODEL_PATH": str(model),
        # The GPU example's settings (examples/gpu.yaml): one micro-batch per step.
        "PODRL_TRAINER__MICRO_BATCH_SIZE": str(args.micro_batch_size),
        "PODRL_TRAINER__LR": "1e-5",
        "PODRL_TRAINER__COMPILE_LAYERS": "true" if args.compile_layers else "false",
        **{f"PODRL_TRAINER__{key.upper()}": str(value) for key, value in trainer.items()},
    }
    return TrainerEngine.build(load_config(None, env))


def make_request(workload: dict[str, Any], vocab: int, seed: int, version: int):
    """One step's batch: every group shares its prompt, lengths drawn per sample."""
    from podrl.v1 import trainer_pb2

    rng = random.Random(seed)
    request = trainer_pb2.TrainRequest(policy_version=version)
    for prompt_index in range(workload["prompts"]):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(*workload["prompt_tokens"]))]
        for sample in range(workload["group"]):
            completion = [
                rng.randrange(1, vocab) for _ in range(rng.randint(*workload["completion_tokens"]))
            ]
            request.sequences.add(
                sample_id=f"p{prompt_index}s{sample}",
                prompt_ids=prompt,
                completion_ids=completion,
                # Near the random model's own logprobs, so ratios start near 1.
                generator_logprobs=[-math.log(vocab)] * len(completion),
                advantage=1.0 if sample % 2 else -1.0,
                policy_version=version,
            )
    return request


def batch_facts(request) -> dict[str, int]:
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in request.sequences]
    return {
        "sequences": len(lengths),
        "tokens": sum(lengths),
        "longest": max(lengths),
        "distinct_lengths": len(set(lengths)),
    }


# -- what a step did besides computing ------------------------------------------------------------


class StepWatch:
    """Counters read before and after each step: graphs compiled, device allocations, garbage
    collections (and their time)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.gc_seconds = 0.0
        self.gc_runs = 0
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_runs += 1
            self.gc_seconds += time.perf_counter() - self._gc_started

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def read(self) -> dict[str, float]:
        try:
            from torch._dynamo.utils import counters

            graphs = float(counters["stats"]["unique_graphs"])
        except Exception:  # no dynamo in this torch build
            graphs = 0.0
        values = {"graphs": graphs, "gc_runs": float(self.gc_runs), "gc_s": self.gc_seconds}
        if self.device == "cuda":
            stats = torch.cuda.memory_stats()
            values["device_allocs"] = float(stats.get("num_device_alloc", 0))
            values["alloc_retries"] = float(stats.get("num_alloc_retries", 0))
        return values


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: after[key] - before.get(key, 0.0) for key in after}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    return {"median": statistics.median(ordered), "p90": p90, "max": ordered[-1]}


def explain(step: dict[str, Any], median_s: float, median_tokens: float) -> str:
    """One line: what made this step slower than twice the median."""
    causes = []
    counts = step["counters"]
    if counts.get("graphs", 0) > 0:
        causes.append(f"{counts['graphs']:.0f} graph(s) compiled (torch.compile, a new shape)")
    if counts.get("device_allocs", 0) > 0:
        causes.append(f"{counts['device_allocs']:.0f} new device allocation(s) (cudaMalloc)")
    if counts.get("alloc_retries", 0) > 0:
        causes.append("the caching allocator freed its cache and retried (memory full)")
    if counts.get("gc_runs", 0) > 0:
        causes.append(f"garbage collection {counts['gc_s'] * 1e3:.1f} ms")
    if step["index"] == 0:
        causes.append("the first step (lazy initialisation: kernels, autotuning, allocator)")
    if step["batch"]["tokens"] > 1.5 * median_tokens:
        causes.append(
            f"a larger batch ({step['batch']['tokens']} tokens, median {median_tokens:.0f})"
        )
    if step.get("top_phase"):
        causes.append(f"most of the excess in {step['top_phase']}")
    cause = "; ".join(causes) or "no counter moved: host noise (another process on the cores)"
    seconds = step["seconds"]
    return (
        f"step {step['index']}: {seconds * 1e3:.1f} ms = {seconds / median_s:.1f}x the median: "
        f"{cause}"
    )


# -- the phase wrappers ------------------------------------------------------------------------


class PhaseClock:
    """Exclusive wall time per named part of a step (children subtracted)."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.totals: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, children's time]

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        sync(self.device)
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            sync(self.device)
            took = time.perf_counter() - frame[0]
            self._stack.pop()
            self.totals[name] = self.totals.get(name, 0.0) + took - frame[1]
            if self._stack:
                self._stack[-1][1] += took

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.part(name):
                return fn(*args, **kwargs)

        return timed


@contextmanager
def phases_wrapped(engine, clock: PhaseClock) -> Iterator[None]:
    """The engine's parts wrapped by ``clock`` (module functions, methods and torch's backward)."""
    import podrl.trainer.engine as engine_module
    from podrl.trainer.batch import MicroBatch

    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        patches.append((owner, name, original))
        setattr(owner, name, clock.wrap(label, original))

    patch(engine_module, "split_for_rank", "collate")
    patch(engine_module, "collate", "collate")
    patch(MicroBatch, "to", "copy to device")
    patch(engine, "_token_logprobs", "forward")
    patch(engine_module, "policy_loss", "loss")
    patch(torch.Tensor, "backward", "backward")
    patch(engine_module, "clip_grad_norm", "grad norm + clip")
    patch(engine_module, "_require_finite_step", "finiteness check")
    patch(engine_module, "snapshot_parameters", "snapshot for the update size")
    patch(engine.optimizer, "step", "optimizer")
    patch(engine_module, "update_ratio", "update size")
    patch(engine.optimizer, "zero_grad", "zero_grad")
    patch(engine, "_agree", "agreement")
    try:
        yield
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


# -- one variant -------------------------------------------------------------------------------


def count_host_syncs(engine, request, device: str) -> int | None:
    """Host synchronisations of one step (CUDA's sync debug mode warns at each); None on CPU."""
    if device != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.train_step(request)
            sync(device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def profile_step(engine, request, device: str) -> dict[str, Any]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        engine.train_step(request)
        sync(device)
        wall = time.perf_counter() - started
    cpu = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    syncs = [e for e in cpu if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    launches = [e for e in cpu if e.name in ("cudaLaunchKernel", "cuLaunchKernel")]
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    try:
        table = prof.key_averages().table(sort_by=sort, row_limit=25)
    except Exception:  # the key's name differs between torch versions
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25)
    return {
        "wall_ms": wall * 1e3,
        "stream_syncs": len(syncs),
        "kernel_launches": len(launches),
        "fsdp_cpu_ms": sum(e.cpu_time_total for e in cpu if e.name.startswith("FSDP::")) / 1e3,
        "top_ops": table,
    }


def run_variant(
    name: str, model: Path, workload_name: str, device: str, args: argparse.Namespace
) -> dict[str, Any]:
    workload = WORKLOADS[workload_name]
    engine = build_engine(model, device, args, VARIANTS[name])
    vocab = engine.model.config.vocab_size
    watch = StepWatch(device)
    try:
        requests = [
            make_request(workload, vocab, seed, 0) for seed in range(args.warmup + args.steps)
        ]

        def step(request) -> float:
            request.policy_version = engine.policy_version
            for seq in request.sequences:
                seq.policy_version = engine.policy_version
            sync(device)
            started = time.perf_counter()
            engine.train_step(request)
            sync(device)
            return time.perf_counter() - started

        timed = []
        for index, request in enumerate(requests):
            before = watch.read()
            seconds = step(request)
            timed.append(
                {
                    "index": index,
                    "seconds": seconds,
                    "counters": delta(watch.read(), before),
                    "batch": batch_facts(request),
                }
            )
        measured = timed[args.warmup :]
        times = summary([s["seconds"] for s in measured])
        median_tokens = statistics.median(s["batch"]["tokens"] for s in measured)

        clock = PhaseClock(device)
        per_step_phases = []
        with phases_wrapped(engine, clock):
            for request in requests[args.warmup :]:
                clock.totals = {}
                seconds = step(request)
                parts = dict(clock.totals)
                parts["other"] = max(0.0, seconds - sum(parts.values()))
                per_step_phases.append({"seconds": seconds, "parts": parts})
        names = sorted({n for s in per_step_phases for n in s["parts"]})
        phase_medians = {
            n: statistics.median(s["parts"].get(n, 0.0) for s in per_step_phases) for n in names
        }
        for step_row, phase_row in zip(measured, per_step_phases, strict=True):
            excess = {n: phase_row["parts"].get(n, 0.0) - phase_medians[n] for n in names}
            top = max(excess, key=excess.get)
            if phase_row["seconds"] > 2 * statistics.median(p["seconds"] for p in per_step_phases):
                step_row["top_phase"] = f"{top} (+{excess[top] * 1e3:.1f} ms in the phases pass)"
        spikes = [
            explain(s, times["median"], median_tokens)
            for s in timed
            if s["seconds"] > 2 * times["median"]
        ]
        request = requests[-1]
        request.policy_version = engine.policy_version
        for seq in request.sequences:
            seq.policy_version = engine.policy_version
        host_syncs = count_host_syncs(engine, request, device)
        request.policy_version = engine.policy_version
        for seq in request.sequences:
            seq.policy_version = engine.policy_version
        profiled = profile_step(engine, request, device)
    finally:
        watch.close()
        engine.close()
    return {
        "workload": workload_name,
        "variant": name,
        "trainer": VARIANTS[name],
        "fsdp": engine.fsdp,
        "step_ms": {k: v * 1e3 for k, v in times.items()},
        "phases_ms": {n: phase_medians[n] * 1e3 for n in names},
        "phases_step_ms": {
            k: v * 1e3 for k, v in summary([p["seconds"] for p in per_step_phases]).items()
        },
        "host_syncs_per_step": host_syncs,
        "spikes": spikes,
        "steps": timed,
        "profile": profiled,
    }


def print_row(row: dict[str, Any]) -> None:
    step = row["step_ms"]
    print(
        f"\n== workload {row['workload']}, {row['variant']} (fsdp {row['fsdp']}): step "
        f"median {step['median']:.1f} ms, p90 {step['p90']:.1f}, max {step['max']:.1f}; "
        f"host syncs per step {row['host_syncs_per_step']}; profiled step "
        f"{row['profile']['wall_ms']:.1f} ms, FSDP CPU {row['profile']['fsdp_cpu_ms']:.1f} ms, "
        f"{row['profile']['kernel_launches']} kernel launches"
    )
    total = sum(row["phases_ms"].values())
    print(f"   phases (device synchronised at each part's ends; medians, sum {total:.1f} ms):")
    for name, ms in sorted(row["phases_ms"].items(), key=lambda kv: -kv[1]):
        print(f"     {name:32s} {ms:8.2f} ms  {ms / max(total, 1e-9):6.1%}")
    for line in row["spikes"] or ["no step over twice the median"]:
        print(f"   spike: {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default="0.6b", help="tiny, 0.6b, 1.7b, ...")
    parser.add_argument("--workloads", default="A,B")
    parser.add_argument("--variants", default="after", help="after, before (comma-separated)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=128)
    parser.add_argument(
        "--compile-layers", action="store_true", help="compiled decoder layers (default: eager)"
    )
    parser.add_argument("--model", type=Path, help="an existing model folder (else written)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.pop("MASTER_ADDR", None)  # one process: the engine's in-process store
    model = args.model
    if model is None:
        model = Path(tempfile.mkdtemp(prefix="podrl-profile-model-")) / args.shape
        write_model(args.shape, model, args.device)
    rows = []
    for workload in args.workloads.split(","):
        for variant in args.variants.split(","):
            row = run_variant(variant, model, workload, args.device, args)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()  # the next variant builds its own model
            print_row(row)
            rows.append(row)
    result = {
        "settings": {
            "device": args.device,
            "shape": args.shape,
            "steps": args.steps,
            "warmup": args.warmup,
            "micro_batch_size": args.micro_batch_size,
            "compile_layers": args.compile_layers,
            "workloads": {w: WORKLOADS[w] for w in args.workloads.split(",")},
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        },
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "services"))
    raise SystemExit(main())
