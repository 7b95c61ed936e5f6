"""The GPU speed benches' pure parts and a CPU rehearsal (docs/performance.md, "On the GPU"):
bench/vs_trl_gpu.py's speed mode (workloads A and B, rows with speedups over TRL, the services'
start-up times from `podrl run`'s output) and bench/train_step_profile.py (the real train step,
phase by phase, spikes explained)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import train_step_profile, vs_trl_gpu
from podrl.cli.local_cluster import ready_line
from podrl.config import load_config


def test_the_speed_workloads_are_valid_runs_of_their_shapes(tmp_path: Path) -> None:
    opts = vs_trl_gpu.parse_args(["--speed", "--workloads", "A,B", "--speed-steps", "B=4"])
    assert opts.speed and opts.workloads == ("A", "B") and opts.speed_steps == {"B": 4}
    for workload, prompts, tokens, steps in (("A", 16, 6, 20), ("B", 64, 256, 4)):
        config = vs_trl_gpu.speed_config(opts, workload)
        path = tmp_path / f"{workload}.yaml"
        path.write_text(json.dumps(config))
        run = load_config(path, env={})
        assert run.loop.prompts_per_step == prompts and run.loop.sampling.n == 8
        assert run.loop.sampling.max_tokens == tokens and run.loop.steps == steps
        assert run.loop.eval_prompts == 0
    # B runs every completion to the budget: no stop string, room for prompt and completion.
    b = load_config(tmp_path / "B.yaml", env={})
    assert b.loop.sampling.stop == [] and b.generator.max_model_len >= 256 + 16


STARTED = {"phases": None, "first_step_s": 40.0, "ready_s": None}


def test_speed_rows_carry_the_figures_and_their_speedup_over_trl() -> None:
    config = vs_trl_gpu.speed_config(vs_trl_gpu.Options(device="cpu"), "A")
    rows = [
        vs_trl_gpu.speed_row("A", system, config, {"step_ends": ends, **STARTED})
        for system, ends in (("trl", [0.0, 1.0, 2.0]), ("podrl-sync", [5.0, 5.5, 6.0]))
    ]
    trl, podrl = vs_trl_gpu.with_speedups(rows)
    assert set(vs_trl_gpu.SPEED_KEYS) <= set(podrl)
    assert (trl["s_per_step"], podrl["s_per_step"]) == (1.0, 0.5)
    assert (trl["samples_per_s"], podrl["samples_per_s"]) == (128.0, 256.0)
    assert (trl["speedup_vs_trl"], podrl["speedup_vs_trl"]) == (1.0, 2.0)


def test_the_speed_rows_read_the_start_up_times_podrl_run_printed(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    line = ready_line({"controller": 2.04, "generator": 41.26, "trainer": 12.0})
    log.write_text(f"podrl: starting\npodrl: {line}\n")
    assert vs_trl_gpu.ready_seconds(log) == {"controller": 2.0, "generator": 41.3, "trainer": 12.0}


def test_a_spike_is_explained_by_what_moved_during_its_step() -> None:
    step = {
        "index": 7,
        "seconds": 0.9,
        "counters": {"graphs": 2.0, "device_allocs": 0.0, "gc_runs": 1.0, "gc_s": 0.012},
        "batch": {"tokens": 400},
    }
    line = train_step_profile.explain(step, median_s=0.3, median_tokens=390)
    assert line.startswith("step 7: 900.0 ms = 3.0x the median: 2 graph(s) compiled")
    assert "garbage collection 12.0 ms" in line
    quiet = {**step, "counters": {}, "index": 3}
    assert "no counter moved" in train_step_profile.explain(quiet, 0.3, 390)


def test_the_profile_runs_the_real_train_step_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    code = train_step_profile.main(
        ["--device", "cpu", "--shape", "tiny", "--workloads", "A", "--variants", "after",
         "--steps", "3", "--warmup", "1", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["workload"] == "A" and row["fsdp"] is False
    assert set(row["step_ms"]) == {"median", "p90", "max"}
    for phase in ("forward", "backward", "optimizer", "collate", "grad norm + clip", "other"):
        assert phase in row["phases_ms"], phase
    assert len(row["steps"]) == 4 and row["steps"][0]["batch"]["sequences"] == 128
    assert row["profile"]["wall_ms"] > 0 and row["host_syncs_per_step"] is None  # CPU
