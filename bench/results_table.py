"""Each bench's results as one markdown table, ``bench/results/<bench>.md``.

A bench writes its JSON into ``bench/results/`` and then calls ``update(<bench>, <that path>)``:
the bench's table is rendered again from every JSON file of that bench in the same folder
(``<bench>.json`` and ``<bench>_<variant>.json``), one row per measured row, so a design page
can state the current figure in a sentence and link here for the history. The JSON files stay
the record; the table is derived, and ``python -m bench.results_table`` renders every table
from the committed JSON (``tests/foundation/test_bench_tables.py`` checks they agree).

Text below the table's end marker (a "Notes" section: what changed between runs, what no JSON
holds) is written by hand and kept when the table is rendered again.

A row is dated by its JSON's own ``date`` and ``commit`` fields, which a bench takes from
``stamp()`` when it assembles its result (``started``, seconds since the epoch, for
``bench/vllm_cuda.py``); files written before that have neither. The table adds no date of its
own, so rendering it again from the same JSON gives the same table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
DATE_FORMAT = "%Y-%m-%d %H:%M UTC"
END_MARKER = "<!-- end of the generated table: notes below are kept -->"


@dataclass(frozen=True)
class Layout:
    """How a bench's JSON becomes rows.

    ``rows`` are paths (``/``-separated keys) to the lists of records, or to a dict of records
    whose key is the column path ``@``; ``()`` makes the whole file one row. A column path is
    read in the record, or from the file's top when it starts with ``/``; ``a|b`` takes the
    first that is present (files of one bench written by different versions of it).
    """

    columns: tuple[tuple[str, str], ...]
    rows: tuple[str, ...] = ()


_MACHINE = (("cpus", "/machine/cpus"), ("gpu", "/machine/gpu|/environment/gpu"))

LAYOUTS: dict[str, Layout] = {
    "async_vs_sync": Layout(
        rows=("rows",),
        columns=(
            *_MACHINE,
            ("async weight apply", "/settings/weight_apply"),
            ("mode", "mode"),
            ("max staleness", "max_staleness"),
            ("steps/s (median run)", "steps_per_s"),
            ("speedup", "speedup"),
            ("held-out accuracy", "final_eval_accuracy"),
            ("generate s", "phase_seconds_median/generate"),
            ("train s", "phase_seconds_median/train"),
            ("sync s", "phase_seconds_median/sync"),
            ("wait for batch s", "phase_seconds_median/wait_for_batch"),
            ("groups dropped stale", "groups_dropped_stale"),
            ("samples spanning versions", "samples_spanning_versions"),
            ("target met", "/met"),
        ),
    ),
    "vs_trl_gpu": Layout(
        rows=("rows",),
        columns=(
            ("gpu", "/environment/gpu"),
            ("shape", "/options/shape"),
            ("variant", "variant"),
            ("warm-start steps", "warm_steps|/options/warm_steps"),
            ("lr", "lr|/recipe/trainer/lr"),
            ("temperature", "temperature|/recipe/loop/sampling/temperature"),
            ("system", "system"),
            ("seed", "seed"),
            ("s/step", "s_per_step"),
            ("samples/s", "samples_per_s"),
            ("reward first 5", "reward_first5"),
            ("reward last 10", "reward_last10"),
            ("held-out before", "heldout_before"),
            ("held-out after", "heldout_after"),
            ("podrl's own evaluation after", "podrl_eval_after"),
            ("mismatch KL (mean)", "mismatch_kl_mean"),
            ("update ratio (mean)", "update_ratio_mean"),
        ),
    ),
    "tool_use_demo": Layout(
        rows=("runs",),
        columns=(
            *_MACHINE,
            ("warm-start steps", "/warm_start/steps"),
            ("seed", "seed"),
            ("held-out before", "before/accuracy"),
            ("after", "after/accuracy"),
            ("tool-call rate before", "before/tool_call_rate"),
            ("after", "after/tool_call_rate"),
            ("accuracy with a call, after", "after/accuracy_with_tool"),
            ("without a call, after", "after/accuracy_without_tool"),
            ("steps trained", "steps_trained"),
            ("loop wall s", "wall_seconds"),
        ),
    ),
    "cuda_grpo": Layout(
        rows=("runs",),
        columns=(
            ("gpu", "/environment/gpu"),
            ("shape", "/options/shape"),
            ("mode", "mode"),
            ("phase", "phase"),
            ("steps", "steps"),
            ("steps trained", "steps_trained"),
            ("step s (median)", "step_median_seconds"),
            ("generate s", "phase_median_seconds/generate"),
            ("train s", "phase_median_seconds/train"),
            ("sync s", "phase_median_seconds/sync"),
            ("sleep s", "phase_median_seconds/sleep"),
            ("wake s", "phase_median_seconds/wake"),
            ("GPU memory peak MiB", "gpu_memory_peak_mib"),
            ("held-out accuracy before", "initial_eval/accuracy"),
            ("after", "final_eval/accuracy"),
            ("reward first 5", "reward_first5"),
            ("reward last 5", "reward_last5"),
        ),
    ),
    "e2e_step": Layout(
        rows=("rows",),
        columns=(
            *_MACHINE,
            ("system", "system"),
            ("steps", "steps"),
            ("s/step", "s_per_step"),
            ("samples/s", "samples_per_s"),
            ("speedup", "speedup"),
            ("generate s", "phase_median_s/generate"),
            ("score s", "phase_median_s/score"),
            ("train s", "phase_median_s/train"),
            ("sync s", "phase_median_s/sync"),
            ("reward first 5", "reward_first5"),
            ("reward last 10", "reward_last10"),
        ),
    ),
    "multi_turn": Layout(
        rows=("rows",),
        columns=(
            *_MACHINE,
            ("model", "/settings/model"),
            ("episodes", "episodes"),
            ("row", "row"),
            ("tokens per turn", "tokens_per_turn"),
            ("episodes/s", "episodes_per_s"),
            ("generated tokens/s", "tokens_per_s"),
            ("vs single-turn", "vs_single_turn"),
            ("prefilled tokens", "prefilled_tokens"),
            ("prefix-cache hit rate", "prefix_cache_hit_rate"),
        ),
    ),
    "generator_cpu": Layout(
        rows=("rows",),
        columns=(
            *_MACHINE,
            ("engine core", "engine_core"),
            ("CPU linear weights", "cpu_linear_weights"),
            ("apply mode", "resolved_apply_mode"),
            ("generate s", "generate_s"),
            ("generate s, vLLM's stop", "generate_vllm_stop_s"),
            ("full apply ms", "apply_full_ms"),
            ("version-only apply ms", "apply_version_only_ms"),
        ),
    ),
    "images_fresh_clone": Layout(
        rows=("images",),
        columns=(
            ("cpus", "/cpus"),
            ("engine", "/engine"),
            ("variant", "/variant"),
            ("base image s", "/base_image/seconds"),
            ("base image MB", "/base_image/size_mb"),
            ("image", "ref"),
            ("build s", "seconds"),
            ("size MB", "size_mb"),
            ("make images s", "/images_seconds"),
        ),
    ),
    "in_flight_apply": Layout(
        rows=("rows",),
        columns=(
            *_MACHINE,
            ("engine core", "/settings/engine_core"),
            ("apply", "kind"),
            ("round trip ms (median, under Generate load)", "round_trip_ms_median"),
            ("in the worker ms", "worker_apply_ms_median"),
            ("round trip ms, idle generator", "/idle_round_trip_ms_median"),
        ),
    ),
    "sampling_seed": Layout(
        columns=(
            ("device", "device"),
            ("model", "model"),
            ("batch-invariant kernels", "vllm_batch_invariant"),
            ("prompts", "prompts"),
            ("n", "n"),
            ("max tokens", "max_tokens"),
            ("temperature", "temperature"),
            ("identical, same batch", "same_batch/identical_fraction"),
            ("identical, split over two batches", "other_batch/identical_fraction"),
            (
                "first difference (median token), same batch",
                "same_batch/first_difference_median_token",
            ),
            ("first difference, two batches", "other_batch/first_difference_median_token"),
            ("tokens/s seeded", "seeded_tokens_per_s"),
            ("tokens/s unseeded", "unseeded_tokens_per_s"),
        ),
    ),
    "scaling": Layout(
        rows=("rows",),
        columns=(
            *_MACHINE,
            ("pods", "pods"),
            ("steps/s", "steps_per_s"),
            ("samples/s", "samples_per_s"),
            ("sync ms (median over pods)", "sync_ms"),
            ("sync ms (slowest pod)", "sync_ms_max"),
            ("sync 3 pods / 1 pod", "/sync_ratio_3_to_1"),
            ("sync flat", "/sync_flat"),
        ),
    ),
    "trainer_throughput": Layout(
        rows=("results", "before"),
        columns=(
            ("gpu", "/settings/device"),
            ("shape", "shape"),
            ("variant", "variant"),
            ("batch", "batch|/settings/batch"),
            ("dp", "dp"),
            ("tp", "tp"),
            ("step s", "step_s|step_seconds"),
            ("tokens/s", "tokens_per_s|tokens_per_second"),
            ("MFU", "mfu"),
            ("peak GiB", "peak_gib|peak_memory_gib"),
        ),
    ),
    "vllm_cuda": Layout(
        rows=("measured/sync",),
        columns=(
            ("gpu", "/environment/gpu"),
            ("engine core", "/facts/engine/extra/engine_core"),
            ("shape", "@"),
            ("sync ready → ack s (median)", "ready_to_ack_s/median"),
            ("apply in the worker s", "apply_in_worker_s/median"),
            ("sync / memcpy", "ratio_to_memcpy_median"),
            ("generate tokens/s, gRPC", "/measured/throughput/tokens_per_s/grpc/median"),
            ("in process", "/measured/throughput/tokens_per_s/in_process/median"),
        ),
    ),
    "weight_sync": Layout(
        rows=("results",),
        columns=(
            ("device", "device"),
            ("where", "placement"),
            ("shape", "shape"),
            ("layers", "layers"),
            ("dtypes", "src_dtype"),
            ("to", "dst_dtype"),
            ("memcpy ms", "memcpy_ms"),
            ("podrl sync ms", "podrl_ms"),
            ("before ms", "legacy_podrl_ms"),
            ("copy ms", "staged_plan_ms"),
            ("sync / memcpy", "podrl_over_memcpy"),
            ("buckets ms", "buckets_ms"),
            ("per-param ms", "per_param_ms"),
        ),
    ),
}


def _get(node: Any, path: str) -> tuple[bool, Any]:
    for key in path.split("/"):
        if not isinstance(node, dict) or key not in node:
            return False, None
        node = node[key]
    return True, node


def _lookup(record: dict[str, Any], key: str | None, data: dict[str, Any], path: str) -> Any:
    """The column's value; ``...`` when no alternative of the path is present."""
    for alternative in path.split("|"):
        if alternative == "@":
            return key
        if alternative.startswith("/"):
            found, value = _get(data, alternative[1:])
        else:
            found, value = _get(record, alternative)
        if found:
            return value
    return ...


def _cell(value: Any) -> str:
    if value is ...:
        return ""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        value = json.dumps(value, sort_keys=True)
    return str(value).replace("|", "\\|").replace("\n", " ")


def _records(data: dict[str, Any], layout: Layout) -> list[tuple[str | None, dict[str, Any]]]:
    if not layout.rows:
        return [(None, data)]
    records: list[tuple[str | None, dict[str, Any]]] = []
    for path in layout.rows:
        found, node = _get(data, path)
        if isinstance(node, list) and found:
            records.extend((None, r) for r in node if isinstance(r, dict))
        elif isinstance(node, dict) and found:
            records.extend((k, r) for k, r in node.items() if isinstance(r, dict))
    return records


def bench_files(bench: str, folder: Path) -> list[Path]:
    """The JSON files of ``bench`` in ``folder``: ``<bench>.json`` and ``<bench>_*.json``,
    less those of a bench whose name is longer (``scaling`` against a ``scaling_x`` bench)."""
    longer = [b for b in LAYOUTS if b != bench and b.startswith(bench + "_")]
    found = []
    for path in sorted(folder.glob("*.json")):
        stem = path.stem
        if stem != bench and not stem.startswith(bench + "_"):
            continue
        if any(stem == b or stem.startswith(b + "_") for b in longer):
            continue
        found.append(path)
    return found


def render(bench: str, files: list[Path]) -> str:
    """The generated part of ``<bench>.md``: a heading, where it comes from, one table."""
    layout = LAYOUTS[bench]
    loaded = [(path, json.loads(path.read_text())) for path in files]
    # ``started`` (seconds since the epoch): bench/vllm_cuda.py's own start time.
    stamps = [("date", "/date|/started"), ("commit", "/commit")]
    stamps = [s for s in stamps if any(_lookup(d, None, d, s[1]) is not ... for _, d in loaded)]
    columns = [("JSON", ""), *stamps, *layout.columns]
    lines = [
        f"# `bench/{bench}.py` results",
        "",
        f"Rendered by `python -m bench.results_table` from the JSON files of `bench/{bench}.py`",
        "in this folder, one row per measured row: an empty cell is a figure that file does not",
        "have, — one the bench recorded as unknown.",
        "A row is dated by its JSON's `date` and `commit` where it has them."
        if stamps
        else "These files carry no date or commit: the notes say when they ran.",
        "",
        "| " + " | ".join(header for header, _ in columns) + " |",
        "| " + " | ".join("---" for _ in columns) + " |",
    ]
    for path, data in loaded:
        for key, record in _records(data, layout):
            values = [_lookup(record, key, data, p) for _, p in columns[1:]]
            if stamps and isinstance(values[0], float):
                values[0] = datetime.datetime.fromtimestamp(values[0], datetime.UTC)
                values[0] = values[0].strftime(DATE_FORMAT)
            cells = [f"`{path.name}`", *map(_cell, values)]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", END_MARKER]
    return "\n".join(lines) + "\n"


def split(text: str) -> tuple[str, str]:
    """A table file's generated part (through the end marker) and its hand-written notes."""
    head, marker, notes = text.partition(END_MARKER + "\n")
    if not marker:
        return text, ""
    return head + marker, notes


def write_table(bench: str, folder: Path = RESULTS) -> Path:
    """Render ``<folder>/<bench>.md`` from the bench's JSON files there, keeping its notes."""
    table = folder / f"{bench}.md"
    notes = split(table.read_text())[1] if table.exists() else ""
    table.write_text(render(bench, bench_files(bench, folder)) + notes)
    return table


def stamp() -> dict[str, str | None]:
    """When and what a bench run measured, for the top of its JSON: ``date`` (UTC, now) and
    ``commit`` (the checkout's short hash; None outside a git checkout, as on a device machine
    that gets the working tree without ``.git``)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        )
        commit = done.stdout.strip() if done.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        commit = ""
    now = datetime.datetime.now(datetime.UTC)
    return {"date": now.strftime(DATE_FORMAT), "commit": commit or None}


def update(bench: str, written: Path) -> Path:
    """After a bench wrote ``written``: render its table next to it (``bench/results/<bench>.md``
    for the default paths; a run writing elsewhere, as the device runs do, gets its table there)."""
    return write_table(bench, written.parent)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("benches", nargs="*", help="default: every bench with a layout")
    parser.add_argument("--folder", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    for bench in args.benches or sorted(LAYOUTS):
        if bench_files(bench, args.folder):
            print(write_table(bench, args.folder))


if __name__ == "__main__":
    main()
