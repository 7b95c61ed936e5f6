"""Trainer throughput on CUDA: one GRPO ``train_step`` of podrl's TrainerEngine per step.

Real Qwen3-0.6B / 1.7B configurations with random weights, FSDP2 (``--dp``) and tensor parallel
(``--tp``) over NCCL, bf16 compute with fp32 master weights. Prints a table and writes JSON:
tokens/s (prompt + completion tokens through forward and backward) and MFU.

MFU = achieved FLOP/s / (GPUs * peak). Training FLOPs per token follow the PaLM appendix:
6·N (N = parameters without the embedding table) + 12·L·H·Q·T for attention scores (L layers,
H heads, Q head dim, T sequence length). Peak is the H200's dense bf16 rate, 989 TFLOP/s.

  python bench/trainer_throughput.py --shapes 0.6b,1.7b --layouts 1x1,2x1,1x2 --out r.json
  (layout DPxTP; world size = DP*TP GPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from podrl.models.qwen3_shapes import QWEN3_SHAPES

PEAK_BF16_FLOPS = 989e12


def write_random_model(shape: str, out: Path) -> int:
    """A Qwen3 folder with random bf16 weights (created on the GPU: fast); returns N params."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**QWEN3_SHAPES[shape], max_position_embeddings=4096)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    count = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return count


def train_flops_per_token(shape: str, params: int, seq: int) -> float:
    cfg = QWEN3_SHAPES[shape]
    non_embedding = params - cfg["vocab_size"] * cfg["hidden_size"]
    attention = 12 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"] * seq
    return 6 * non_embedding + attention


def synthetic_request(batch: int, prompt: int, completion: int, vocab: int, seed: int):
    from podrl.v1 import trainer_pb2

    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for i in range(batch):
        ids = torch.randint(0, vocab, (prompt + completion,), generator=gen).tolist()
        sequences.append(
            trainer_pb2.TrainSequence(
                sample_id=f"s{i}",
                prompt_ids=ids[:prompt],
                completion_ids=ids[prompt:],
                generator_logprobs=[-12.0] * completion,  # about log(1/vocab): random weights
                advantage=1.0 if i % 2 else -1.0,
                policy_version=0,
            )
        )
    return trainer_pb2.TrainRequest(sequences=sequences)


def rank_main(rank: int, args: argparse.Namespace, model_dir: str, port: int, queue) -> None:
    dp, tp = args.layout
    world = dp * tp
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    from podrl.config import load_config
    from podrl.trainer.engine import TrainerEngine

    config = load_config(
        env={
            "PODRL_DEVICE": "cuda",
            "PODRL_RUN_DIR": tempfile.mkdtemp(),
            "PODRL_TRAINER__MODEL_PATH": model_dir,
            "PODRL_TRAINER__DP_SHARD": str(dp),
            "PODRL_TRAINER__TP": str(tp),
            "PODRL_TRAINER__MICRO_BATCH_SIZE": str(args.micro_batch),
            "PODRL_TRAINER__LR": "1e-6",
        }
    )
    engine = TrainerEngine(config)
    vocab = engine.model.config.vocab_size
    # Every DP rank gets batch_per_gpu sequences: the request holds the global batch.
    times, losses = [], []
    for step in range(args.steps):
        request = synthetic_request(args.batch * dp, args.prompt, args.completion, vocab, step)
        request.policy_version = engine.policy_version
        torch.cuda.synchronize()
        start = time.perf_counter()
        reply = engine.train_step(request)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(reply.metrics.loss)
    if rank == 0:
        queue.put(
            {
                "times": times,
                "losses": losses,
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
            }
        )
    engine.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="0.6b,1.7b")
    parser.add_argument("--layouts", default="1x1,2x1,1x2", help="DPxTP list")
    parser.add_argument("--batch", type=int, default=8, help="sequences per DP rank")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=768)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="the first is warm-up")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("trainer_throughput: no CUDA device", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    seq = args.prompt + args.completion
    rows = []
    ctx = mp.get_context("spawn")
    for shape in args.shapes.split(","):
        with tempfile.TemporaryDirectory() as model_dir:
            params = write_random_model(shape, Path(model_dir))
            for layout in args.layouts.split(","):
                dp, tp = (int(x) for x in layout.split("x"))
                if dp * tp > gpus:
                    print(f"skip {shape} {layout}: needs {dp * tp} GPUs, have {gpus}")
                    continue
                args.layout = (dp, tp)
                queue = ctx.SimpleQueue()
                port = free_port()
                procs = [
                    ctx.Process(target=rank_main, args=(r, args, model_dir, port, queue))
                    for r in range(dp * tp)
                ]
                for p in procs:
                    p.start()
                for p in procs:
                    p.join()
                if any(p.exitcode for p in procs) or queue.empty():
                    print(f"{shape} {layout}: a rank failed", file=sys.stderr)
                    return 1
                result = queue.get()
                step_s = statistics.median(result["times"][1:])
                tokens = args.batch * dp * seq
                tps = tokens / step_s
                flops = train_flops_per_token(shape, params, seq) * tps
                rows.append(
                    dict(
                        shape=shape, dp=dp, tp=tp, gpus=dp * tp, params=params,
                        tokens_per_step=tokens, step_seconds=step_s, tokens_per_second=tps,
                        tokens_per_second_per_gpu=tps / (dp * tp),
                        mfu=flops / (PEAK_BF16_FLOPS * dp * tp), losses=result["losses"],
                        peak_memory_gib=result["peak_memory_gib"],
                    )
                )  # fmt: skip
    print(
        f"{'shape':6} {'DPxTP':6} {'tok/step':>9} {'step s':>8} {'tok/s':>10} {'MFU':>6} {'GiB':>6}"
    )
    for r in rows:
        print(
            f"{r['shape']:6} {r['dp']}x{r['tp']:<4} {r['tokens_per_step']:>9} "
            f"{r['step_seconds']:>8.3f} {r['tokens_per_second']:>10.0f} {r['mfu']:>6.1%} "
            f"{r['peak_memory_gib']:>6.1f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "layout")}
    args.out.write_text(json.dumps({"settings": settings, "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
