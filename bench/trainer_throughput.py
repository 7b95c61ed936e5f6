"""Trainer throughput on one GPU: podrl's GRPO step against a plain transformers step.

One run measures, on the same machine, the same random-weight Qwen3 shapes and the same
batches:

* ``podrl``: ``TrainerEngine.train_step`` with the configured defaults (packing, fused chunked
  logprobs, compiled decoder layers, fused AdamW, foreach clipping);
* ``baseline``: a plain transformers model with the same FSDP2 setup (``fully_shard`` per
  decoder layer and the root, bf16 parameters with fp32 reduce and fp32 master weights),
  transformers' SDPA with the padding mask, full logits and a full fp32 ``log_softmax`` over
  the vocabulary, the same GRPO loss (``podrl.algorithms.losses.policy_loss``), backward,
  ``torch.nn.utils.clip_grad_norm_`` and torch's default AdamW;
* optionally ``--before DIR``: podrl's engine from an older source tree (``DIR`` holds its
  ``podrl`` package), for before/after profiles; its rows go to the JSON's ``before`` list.

Batches (``--batches``): ``padded`` = ``--batch`` sequences of exactly ``--prompt`` +
``--completion`` tokens (no padding anywhere); ``mixed`` = ``--mixed-batch`` sequences of a GRPO
length mix (prompts uniform in [128, 512] tokens, completions log-normal around 400 tokens,
clipped to [32, 1536]; fixed seed), padded per micro-batch by the baseline and packed by podrl.
For ``mixed`` the podrl row also carries the same step with packing off
(``unpacked_tokens_per_s``, ``packing_speedup``). Micro-batches: the baseline's hold
``--micro-batch`` sequences; podrl's (packing on or off) at most ``--micro-tokens`` computed
tokens (``trainer.micro_batch_tokens``), the 16,384 tokens a padded micro-batch of 8 x 2,048
holds.

tokens/s counts real tokens (prompt + completion, never padding) per second of the median step
after ``--warmup`` steps. MFU: FLOPs/token = 6·N + 12·L·H·Q·T with N = every
matmul parameter (attention and MLP projections of all layers plus the vocabulary projection,
a tied lm_head counted once), L layers, H heads, Q head dim, T the token's sequence length;
achieved FLOP/s over the H200's dense bf16 peak, 989 TFLOP/s. Peak memory = the largest
``torch.cuda.max_memory_allocated`` from building the model to the last timed step.

``--profile`` runs one more step under ``torch.profiler`` for the padded batch of each variant
and writes a summary (GPU time by kernel class, GPU idle time, host synchronisations, top ops)
to ``--profile-out``.

  python bench/trainer_throughput.py --shapes 0.6b,1.7b --batches padded,mixed \\
      --out bench/results/trainer_throughput_h200.json --profile --profile-out profile.txt
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

PEAK_BF16_FLOPS = 989e12
REPO = Path(__file__).resolve().parents[1]


# -- shapes, FLOPs and batches -----------------------------------------------------------------


# A shape for a CPU dry run of this script (``--device cpu --shapes tiny``), not a benchmark.
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    tie_word_embeddings=True,
)


def qwen3_shape(shape: str) -> dict:
    if shape == "tiny":
        return dict(TINY)
    sys.path.insert(0, str(REPO / "services"))
    from podrl.models.qwen3_shapes import QWEN3_SHAPES

    return dict(QWEN3_SHAPES[shape])


def on_cuda() -> bool:
    return os.environ.get("BENCH_DEVICE", "cuda") == "cuda"


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if on_cuda() else 0.0


def matmul_params(cfg: dict) -> int:
    """N of the MFU formula: every matmul weight, the (tied) vocabulary projection once."""
    d, inter, q = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    attention = d * heads * q * 2 + d * kv * q * 2  # q, o and k, v
    mlp = 3 * d * inter
    return cfg["num_hidden_layers"] * (attention + mlp) + cfg["vocab_size"] * d


def step_flops(cfg: dict, lengths: list[int]) -> float:
    """Training FLOPs of one step over sequences of ``lengths`` tokens (the MFU formula)."""
    n = matmul_params(cfg)
    per_t = 12 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"]
    return float(sum(t * (6 * n + per_t * t) for t in lengths))


def batch_lengths(kind: str, args: argparse.Namespace) -> list[tuple[int, int]]:
    """(prompt, completion) lengths of one step's sequences."""
    if kind == "padded":
        return [(args.prompt, args.completion)] * args.batch
    gen = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(args.mixed_batch):
        prompt = int(torch.randint(128, 513, (1,), generator=gen))
        completion = math.exp(math.log(400) + 0.8 * float(torch.randn(1, generator=gen)))
        out.append((prompt, int(min(max(completion, 32), 1536))))
    return out


def make_request(lengths: list[tuple[int, int]], vocab: int, seed: int, version: int):
    from podrl.v1 import trainer_pb2

    gen = torch.Generator().manual_seed(seed)
    request = trainer_pb2.TrainRequest(policy_version=version)
    for i, (prompt, completion) in enumerate(lengths):
        ids = torch.randint(0, vocab, (prompt + completion,), generator=gen).tolist()
        request.sequences.add(
            sample_id=f"s{i}",
            prompt_ids=ids[:prompt],
            completion_ids=ids[prompt:],
            # log(1/vocab): random weights are near uniform, so the ratios start near 1 and
            # every token has a gradient (clipped tokens would backpropagate zeros).
            generator_logprobs=[-math.log(vocab)] * completion,
            advantage=1.0 if i % 2 else -1.0,
            policy_version=version,
        )
    return request


def write_random_model(shape: str, out: Path) -> None:
    """A Qwen3 folder with random bf16 weights (made on the GPU: fast)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**qwen3_shape(shape), max_position_embeddings=4096, pad_token_id=0)
    with torch.device("cuda" if on_cuda() else "cpu"):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    if on_cuda():
        torch.cuda.empty_cache()


# -- the two steps -------------------------------------------------------------------------------


class PodrlStep:
    def __init__(
        self, model_dir: str, micro_batch: int, micro_tokens: int, overrides: dict[str, str]
    ) -> None:
        from podrl.config import load_config
        from podrl.trainer.engine import TrainerEngine

        env = {
            "PODRL_DEVICE": "cuda" if on_cuda() else "cpu",
            "PODRL_RUN_DIR": tempfile.mkdtemp(),
            "PODRL_TRAINER__MODEL_PATH": model_dir,
            "PODRL_TRAINER__MICRO_BATCH_SIZE": str(micro_batch),
            "PODRL_TRAINER__LR": "1e-6",
            **({"PODRL_TRAINER__MICRO_BATCH_TOKENS": str(micro_tokens)} if micro_tokens else {}),
            **{f"PODRL_TRAINER__{k.upper()}": v for k, v in overrides.items()},
        }
        self.engine = TrainerEngine.build(load_config(None, env))
        self.vocab = self.engine.model.config.vocab_size

    @property
    def version(self) -> int:
        return self.engine.policy_version

    def __call__(self, request) -> float:
        return self.engine.train_step(request).metrics.loss


class BaselineStep:
    """Plain transformers + FSDP2, full fp32 log-softmax (module docstring)."""

    def __init__(self, model_dir: str, micro_batch: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from transformers import AutoModelForCausalLM

        from podrl.algorithms.losses import LossSettings
        from podrl.config.trainer import TrainerConfig

        device = "cuda" if on_cuda() else "cpu"
        if not dist.is_initialized():
            backend = "nccl" if on_cuda() else "gloo"
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        mesh = init_device_mesh(device, (1,))
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        )
        model.config.use_cache = False
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if not on_cuda():
            policy = MixedPrecisionPolicy()
        self.device = torch.device(device)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        defaults = TrainerConfig()
        self.settings = LossSettings(
            mode=defaults.loss_mode,
            clip_eps_low=defaults.clip_eps_low,
            clip_eps_high=defaults.clip_eps_high,
            **(
                {"clip_ratio_c": defaults.clip_ratio_c} if hasattr(defaults, "clip_ratio_c") else {}
            ),
        )
        self.micro_batch = micro_batch
        self.vocab = model.config.vocab_size
        self.version = 0

    def __call__(self, request) -> float:
        from podrl.algorithms.losses import policy_loss
        from podrl.trainer.batch import batch_totals, collate

        sequences = list(request.sequences)
        totals = batch_totals(sequences)
        loss_sum = torch.zeros((), device=self.device)
        for start in range(0, len(sequences), self.micro_batch):
            batch = collate(sequences[start : start + self.micro_batch], 0, packed=False)
            batch = batch.to(self.device)
            logits = self.model(
                input_ids=batch.input_ids, attention_mask=batch.attention_mask
            ).logits
            log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
            targets = batch.input_ids[:, 1:].unsqueeze(-1)
            logprobs = log_probs.gather(-1, targets).squeeze(-1)
            terms = policy_loss(
                logprobs,
                batch.generator_logprobs,
                batch.advantages,
                batch.loss_mask,
                self.settings,
                totals,
            )
            terms.loss.backward()
            loss_sum += terms.loss.detach()
            del logits, log_probs, logprobs, terms
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return float(loss_sum)


# -- profiling -------------------------------------------------------------------------------------

_KERNEL_CLASSES = (
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer (adam)", ("adam",)),
    ("collectives (nccl)", ("nccl",)),
    ("copies/casts", ("memcpy", "memset", "copy", "cat_", "chunk_cat", "split_with_sizes")),
    ("compiled elementwise (triton)", ("triton",)),
    ("softmax/logsumexp (eager)", ("softmax", "logsumexp", "log_softmax")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "sm90", "cublas", "wgmma", "gemv")),
    ("foreach/multi-tensor", ("foreach", "multi_tensor", "multitensor")),
    ("reductions", ("reduce", "norm")),
)


def _kernel_class(name: str) -> str:
    low = name.lower()
    for label, keys in _KERNEL_CLASSES:
        if any(k in low for k in keys):
            return label
    return "other elementwise"


def profile_summary(prof, step_seconds: float, vocab: int) -> str:
    """GPU time by kernel class, GPU idle time, host syncs, vocab matmuls, top ops."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    # Kernels only: not the GPU-side ranges of compiled graphs or record_function annotations.
    kernels = [
        e
        for e in events
        if e.device_type == DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and not e.name.startswith("## ")
        and "#" not in e.name
        and e.name != "Command Buffer Full"
    ]
    by_class: dict[str, float] = {}
    intervals = []
    for e in kernels:
        dur = e.time_range.end - e.time_range.start
        by_class[_kernel_class(e.name)] = by_class.get(_kernel_class(e.name), 0.0) + dur
        intervals.append((e.time_range.start, e.time_range.end))
    intervals.sort()
    busy, cur_start, cur_end = 0.0, None, None
    for s, t in intervals:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = s, t
        else:
            cur_end = max(cur_end, t)
    if cur_end is not None:
        busy += cur_end - cur_start
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    cpu = [e for e in events if e.device_type == DeviceType.CPU]
    syncs = [e for e in cpu if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    scalars = [e for e in cpu if e.name in ("aten::item", "aten::_local_scalar_dense")]
    d2h = [e for e in cpu if e.name in ("cudaMemcpyAsync", "cudaMemcpy")]
    fsdp_cpu = sum(e.cpu_time_total for e in cpu if e.name.startswith("FSDP::"))
    vocab_mm = 0.0
    for e in cpu:
        if e.name in ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear") and any(
            vocab in (s if isinstance(s, list) else []) for s in (e.input_shapes or [])
        ):
            vocab_mm += e.self_device_time_total
    total_kernel = sum(by_class.values())
    lines = [
        f"step (profiled) wall {step_seconds * 1e3:.1f} ms; GPU busy {busy / 1e3:.1f} ms "
        f"({busy / max(span, 1):.1%} of the {span / 1e3:.1f} ms kernel span); "
        f"kernel time {total_kernel / 1e3:.1f} ms over {len(kernels)} kernels",
        f"host syncs: {len(syncs)} stream/device synchronize "
        f"({sum(e.cpu_time_total for e in syncs) / 1e3:.1f} ms), {len(scalars)} item/scalar "
        f"reads, {len(d2h)} cudaMemcpy(Async) calls; FSDP:: CPU ranges "
        f"{fsdp_cpu / 1e3:.1f} ms; vocab-projection matmuls (aten mm with a {vocab} dim) "
        f"{vocab_mm / 1e3:.1f} ms GPU",
        "GPU kernel time by class:",
    ]
    for label, dur in sorted(by_class.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:32s} {dur / 1e3:9.2f} ms  {dur / max(total_kernel, 1):6.1%}")
    for sort_by in ("self_cuda_time_total", "self_device_time_total"):
        try:
            lines.append(prof.key_averages().table(sort_by=sort_by, row_limit=30))
            break
        except Exception:  # the key's name differs between torch versions
            continue
    return "\n".join(lines)


# -- one worker process: one shape, one family of variants ----------------------------------------


def run_variant(step, lengths, args, profile: bool) -> dict:
    """Warm up, time, optionally profile; the row's measurements."""
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        request = make_request(lengths, step.vocab, seed=i, version=step.version)
        sync()
        start = time.perf_counter()
        losses.append(step(request))
        sync()
        times.append(time.perf_counter() - start)
    row = {
        "step_s": statistics.median(times[args.warmup :]),
        "step_times_s": times,
        "losses": losses,
        "peak_gib": peak_gib(),
    }
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        request = make_request(lengths, step.vocab, seed=99, version=step.version)
        sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda() else [])
        with torch_profile(activities=activities, record_shapes=True) as prof:
            start = time.perf_counter()
            step(request)
            sync()
            wall = time.perf_counter() - start
        row["profile"] = profile_summary(prof, wall, step.vocab)
    return row


def worker(spec: dict) -> None:
    """Run every variant of ``spec`` in this process; append rows to ``spec['out']``."""
    args = argparse.Namespace(**spec["args"])
    if on_cuda():
        torch.cuda.set_device(0)
    os.environ.pop("MASTER_ADDR", None)  # one process: the engine uses an in-process store
    for variant in spec["variants"]:
        name, batch, overrides = variant["name"], variant["batch"], variant.get("overrides", {})
        lengths = batch_lengths(batch, args)
        gc.collect()
        if on_cuda():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        result = {
            "variant": name,
            "batch": batch,
            "overrides": overrides,
            "resident_gib_at_start": torch.cuda.memory_allocated() / 2**30 if on_cuda() else 0,
        }
        try:
            if spec["family"] == "baseline":
                step = BaselineStep(spec["model_dir"], args.micro_batch)
            else:
                # The old engine (--before) has no token budget: it gets the baseline's split.
                tokens = args.micro_tokens if spec["family"] == "podrl" else 0
                size = args.podrl_micro_batch if spec["family"] == "podrl" else args.micro_batch
                step = PodrlStep(spec["model_dir"], size, tokens, overrides)
            result.update(run_variant(step, lengths, args, variant.get("profile", False)))
            try:
                from torch._dynamo.utils import counters

                result["dynamo"] = {
                    "unique_graphs": counters["stats"].get("unique_graphs", 0),
                    "graph_breaks": sum(counters["graph_break"].values()),
                    "recompile_limit_hits": sum(
                        v for k, v in counters["stats"].items() if "limit" in k
                    ),
                }
            except Exception:
                pass
            del step
        except Exception as err:  # recorded; the other variants still run
            result["error"] = f"{type(err).__name__}: {err}"
            result["traceback"] = traceback.format_exc()[-4000:]
        with open(spec["out"], "a") as fh:
            fh.write(json.dumps(result) + "\n")
        torch._dynamo.reset()


# -- kernel checks on the device ------------------------------------------------------------------


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def device_checks(vocab: int = 151936, dim: int = 2048) -> dict:
    """The fused logprobs and the packed attention against their plain versions, in bf16 on
    this device (the CPU tests check them in fp32): max |diff| of values, relative L2 error of
    gradients."""
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from podrl.trainer.batch import (
        CU_SEQLENS_KWARG,
        MAX_SEQLEN_KWARG,
        ChunkKernels,
        fused_linear_logprobs,
        plain_logprobs,
        podrl_attention,
    )

    device = "cuda" if on_cuda() else "cpu"
    dtype = torch.bfloat16 if on_cuda() else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    out: dict = {}
    tokens = 5000
    hidden = (torch.randn(tokens, dim, device=device, generator=gen) * 0.5).to(dtype)
    weight = (torch.randn(vocab, dim, device=device, generator=gen) * 0.02).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    upstream = torch.randn(tokens, device=device, generator=gen)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref, ref_entropy = plain_logprobs(h @ w.t(), targets)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (h, w))
    for compiled in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        kernels = ChunkKernels.make(compiled=compiled)
        lp, entropy = fused_linear_logprobs(h, w, targets, 1.0, 2048, kernels)
        grads = torch.autograd.grad((lp * upstream).sum(), (h, w))
        out[f"logprobs_{'compiled' if compiled else 'eager'}"] = {
            "max_abs_logprob_diff": float((lp - ref).detach().abs().max()),
            "max_abs_entropy_diff": float((entropy - ref_entropy).detach().abs().max()),
            "grad_hidden_rel": _rel(grads[0], ref_grads[0]),
            "grad_weight_rel": _rel(grads[1], ref_grads[1]),
        }
    # Packed attention (3 sequences) against SDPA on each sequence alone.
    heads, kv_heads, head_dim, lengths = 16, 8, 128, [700, 1, 1347]
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    total = sum(lengths)
    q = torch.randn(1, heads, total, head_dim, device=device, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, total, head_dim, device=device, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, total, head_dim, device=device, generator=gen).to(dtype)
    grad_out = torch.randn(1, total, heads, head_dim, device=device, generator=gen).to(dtype)
    cu = torch.tensor([0, 700, 701, total], dtype=torch.int32, device=device)
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    packed, _ = podrl_attention(
        module, qs, ks, vs, None, scaling=head_dim**-0.5,
        **{CU_SEQLENS_KWARG: cu, MAX_SEQLEN_KWARG: max(lengths)},
    )  # fmt: skip
    packed_grads = torch.autograd.grad((packed.float() * grad_out.float()).sum(), (qs, ks, vs))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    parts = [
        sdpa_attention_forward(module, a, b, c, None, scaling=head_dim**-0.5)[0]
        for a, b, c in zip(*(t.split(lengths, 2) for t in (qr, kr, vr)), strict=True)
    ]
    reference = torch.cat(parts, dim=1)
    ref_grads = torch.autograd.grad((reference.float() * grad_out.float()).sum(), (qr, kr, vr))
    out["packed_attention"] = {
        "max_abs_out_diff": float((packed - reference).detach().float().abs().max()),
        "out_rel": _rel(packed, reference),
        "grad_rel": [_rel(a, b) for a, b in zip(packed_grads, ref_grads, strict=True)],
    }
    return out


# -- the driver ------------------------------------------------------------------------------------


def run_family(family, variants, shape, model_dir, args, pythonpath) -> list[dict]:
    out = Path(tempfile.mkdtemp()) / "rows.jsonl"
    spec = {
        "family": family,
        "variants": variants,
        "model_dir": str(model_dir),
        "out": str(out),
        "args": {k: v for k, v in vars(args).items() if not isinstance(v, Path)},
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([pythonpath, str(REPO), *sys.path])}
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)], env=env, check=False
    )
    print(
        f"  {shape} {family}: exit {proc.returncode} in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    done = {(r["variant"], r["batch"]) for r in rows}
    for v in variants:  # a worker that died took its remaining variants with it
        if (v["name"], v["batch"]) not in done:
            rows.append({"variant": v["name"], "batch": v["batch"], "error": "worker died"})
    return rows


def finish_row(row: dict, shape: str, cfg: dict, args: argparse.Namespace) -> dict:
    lengths = [p + c for p, c in batch_lengths(row["batch"], args)]
    row = {"shape": shape, **row}
    if "error" in row:
        return row
    tokens = sum(lengths)
    row["tokens_per_step"] = tokens
    row["tokens_per_s"] = tokens / row["step_s"]
    row["mfu"] = step_flops(cfg, lengths) / row["step_s"] / PEAK_BF16_FLOPS
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default="0.6b,1.7b")
    parser.add_argument("--batches", default="padded,mixed")
    parser.add_argument("--batch", type=int, default=8, help="sequences of the padded batch")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--completion", type=int, default=1536)
    parser.add_argument("--mixed-batch", type=int, default=16, help="sequences of the mix")
    parser.add_argument("--micro-batch", type=int, default=8, help="baseline: sequences")
    parser.add_argument(
        "--micro-tokens", type=int, default=16384, help="podrl: computed tokens per micro-batch"
    )
    parser.add_argument("--podrl-micro-batch", type=int, default=64, help="podrl: sequences")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps (median)")
    parser.add_argument("--variants", default="podrl,baseline")
    parser.add_argument("--before", type=Path, help="an older tree holding a podrl package")
    parser.add_argument("--ablations", action="store_true", help="podrl with one knob off")
    parser.add_argument("--checks", action="store_true", help="kernel checks first (bf16)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--profile-out", type=Path, default=Path("trainer_profile.txt"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu = dry run")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.out is None:
        parser.error("--out is required")
    os.environ["BENCH_DEVICE"] = args.device
    if on_cuda() and not torch.cuda.is_available():
        print("trainer_throughput: no CUDA device", file=sys.stderr)
        return 2
    batches = args.batches.split(",")
    families = args.variants.split(",")
    services = str(REPO / "services")
    results, before, ablations, profiles = [], [], [], []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.checks:
        sys.path.insert(0, services)
        # Qwen3-1.7B's vocabulary and width on the GPU; small enough for a CPU dry run there.
        args.check_results = device_checks() if on_cuda() else device_checks(1000, 64)
        print(json.dumps(args.check_results, indent=1), flush=True)
        if on_cuda():
            torch.cuda.empty_cache()
    for shape in args.shapes.split(","):
        cfg = qwen3_shape(shape)
        with tempfile.TemporaryDirectory() as model_dir:
            write_random_model(shape, Path(model_dir))
            plan = variant_plan(args, batches, families, services)
            for family, variants, path in plan:
                for row in run_family(family, variants, shape, model_dir, args, path):
                    row = finish_row(row, shape, cfg, args)
                    if "profile" in row:
                        profiles.append(f"=== {shape} {row['variant']} {row['batch']} ===\n")
                        profiles.append(row.pop("profile") + "\n\n")
                    if family == "before":
                        before.append(row)
                    elif row["variant"].startswith("no_"):
                        ablations.append(row)
                    else:
                        results.append(row)
                    write_outputs(args, results, before, ablations, profiles)
    merge_unpacked(results)
    write_outputs(args, results, before, ablations, profiles)
    print_table(results + before + ablations)
    return 0


def variant_plan(args, batches, families, services) -> list[tuple[str, list[dict], str]]:
    """(family, its variants, the source tree it runs from) for one shape."""

    def variant(name: str, batch: str, **overrides: str) -> dict:
        profile = args.profile and batch == "padded" and name in ("podrl", "baseline", "before")
        return {"name": name, "batch": batch, "overrides": overrides, "profile": profile}

    plan = []
    if args.before:
        plan.append(("before", [variant("before", "padded")], str(args.before.resolve())))
    if "podrl" in families:
        podrl = [variant("podrl", b) for b in batches]
        if "mixed" in batches:
            podrl.append(variant("unpacked", "mixed", packing="false"))
        if args.ablations:
            for knob in ("compile_layers", "fused_logprobs"):
                podrl.append(variant(f"no_{knob}", "padded", **{knob: "false"}))
        plan.append(("podrl", podrl, services))
    if "baseline" in families:
        plan.append(("baseline", [variant("baseline", b) for b in batches], services))
    return plan


def merge_unpacked(results: list[dict]) -> None:
    """Fold the packing-off rows into their podrl mixed row (one row per shape/variant/batch)."""
    for row in [r for r in results if r["variant"] == "unpacked"]:
        results.remove(row)
        for target in results:
            if (target["shape"], target["variant"], target["batch"]) == (
                row["shape"],
                "podrl",
                "mixed",
            ) and "error" not in target:
                if "error" in row:
                    target["unpacked_error"] = row["error"]
                    continue
                target["unpacked_tokens_per_s"] = row["tokens_per_s"]
                target["unpacked_peak_gib"] = row["peak_gib"]
                target["unpacked_losses"] = row["losses"]
                target["packing_speedup"] = target["tokens_per_s"] / row["tokens_per_s"]


def write_outputs(args, results, before, ablations, profiles) -> None:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings.pop("worker", None)
    checks = settings.pop("check_results", None)
    settings["device"] = torch.cuda.get_device_name(0) if on_cuda() else "cpu"
    settings["torch"] = torch.__version__
    settings["mixed_lengths"] = batch_lengths("mixed", args)
    sys.path.insert(0, str(REPO))  # run as a script (python bench/NAME.py): bench is a package
    from bench import results_table

    payload = {
        **results_table.stamp(),
        "settings": settings,
        "results": results,
        "before": before,
        "ablations": ablations,
        "checks": checks,
    }
    args.out.write_text(json.dumps(payload, indent=2))
    results_table.update("trainer_throughput", args.out)
    if profiles:
        args.profile_out.write_text("".join(profiles))


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':6} {'variant':16} {'batch':7} {'tok/s':>9} {'MFU':>6} {'GiB':>6} {'loss1':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:6} {r['variant']:16} {r['batch']:7} ERROR {r['error'][:120]}")
            continue
        extra = f"  packing x{r['packing_speedup']:.2f}" if "packing_speedup" in r else ""
        print(
            f"{r['shape']:6} {r['variant']:16} {r['batch']:7} {r['tokens_per_s']:>9.0f} "
            f"{r['mfu']:>6.1%} {r['peak_gib']:>6.1f} {r['losses'][0]:>9.5f}{extra}"
        )


if __name__ == "__main__":
    sys.exit(main())
