"""Shared-memory segments disappear when the processes exit, also after kill -9 of the trainer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from podrl.v1 import weights_pb2
from podrl.weights import ManifestError, ManifestErrorKind, ModelDescription, WeightReceiver
from podrl.weights.protocol import list_segments
from tests.weights.tiny_qwen3 import CONFIG

REPO_ROOT = Path(__file__).resolve().parents[2]


def _start_publisher(tmp_path: Path) -> tuple[subprocess.Popen, weights_pb2.WeightManifest]:
    out = tmp_path / "manifest.bin"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.weights.shm_publisher", str(out)],
        stdin=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=env,
    )
    deadline = time.monotonic() + 60
    while not out.exists():
        assert process.poll() is None, "publisher died"
        assert time.monotonic() < deadline, "publisher did not publish"
        time.sleep(0.05)
    return process, weights_pb2.WeightManifest.FromString(out.read_bytes())


def _expected_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    description = ModelDescription.from_hf_config(CONFIG)
    return {name: torch.randn(shape) for name, shape in description.params.items()}


@pytest.mark.slow
def test_segments_gone_after_normal_exit(tmp_path: Path) -> None:
    process, manifest = _start_publisher(tmp_path)
    segments = list_segments(process.pid)
    assert len(segments) > 1  # many tensors per segment, several segments
    receiver = WeightReceiver(ModelDescription.from_hf_config(CONFIG))
    applied = dict(receiver.apply(manifest))
    expected = _expected_params()
    assert all(torch.equal(applied[name], expected[name]) for name in expected)

    process.communicate(b"exit\n", timeout=30)
    assert process.returncode == 0
    assert list_segments(process.pid) == []
    # The receiver still holds its own copy; the trainer's memory is gone with the names.
    receiver.close()
    assert list_segments(process.pid) == []


@pytest.mark.slow
def test_segments_reaped_after_kill_9(tmp_path: Path) -> None:
    process, manifest = _start_publisher(tmp_path)
    assert list_segments(process.pid)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert list_segments(process.pid), "kill -9 leaves the names behind until a reaper runs"

    # A manifest from the dead trainer is refused (FAILED_PRECONDITION), and starting the
    # receiver already reaped the orphans.
    receiver = WeightReceiver(ModelDescription.from_hf_config(CONFIG))
    assert list_segments(process.pid) == []
    with pytest.raises(ManifestError) as error:
        receiver.apply(manifest)
    assert error.value.kind is ManifestErrorKind.STORAGE
    assert receiver.fingerprint is None


@pytest.mark.slow
def test_receiver_close_reaps_segments_of_trainer_killed_while_mapped(tmp_path: Path) -> None:
    process, manifest = _start_publisher(tmp_path)
    receiver = WeightReceiver(ModelDescription.from_hf_config(CONFIG))
    receiver.apply(manifest)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    assert list_segments(process.pid)
    receiver.close()
    assert list_segments(process.pid) == []


def test_segments_of_live_processes_are_kept() -> None:
    from podrl.weights.protocol import SharedSegment, reap_orphaned_segments

    segment = SharedSegment(4096)
    try:
        reap_orphaned_segments()
        assert segment.name in list_segments(os.getpid())
    finally:
        segment.unlink()
    assert segment.name not in list_segments(os.getpid())


def _unreadable_proc(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """/proc/<pid>/stat cannot be read (no /proc in the container, or a restricted one)."""
    from podrl.weights import protocol

    empty = tmp_path / "proc"
    empty.mkdir()
    monkeypatch.setattr(protocol, "PROC_DIR", empty)


def test_creator_without_a_readable_start_time_keeps_its_segments_and_they_open(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before: the start time used to be encoded as 0, so every liveness check failed: the live
    segment was reaped and its manifest refused as STORAGE."""
    from podrl.weights import ManifestAssembler, WeightPublisher
    from podrl.weights.protocol import creator_alive, reap_orphaned_segments
    from tests.harness.weights import publish_single_process

    _unreadable_proc(monkeypatch, tmp_path)
    params = _expected_params()
    publisher = WeightPublisher(lambda: params)
    try:
        manifest = publish_single_process(publisher, ManifestAssembler("trainer-0"), 1)
        names = {shard.storage.shm.name for shard in manifest.shards}
        assert all("-unknown-" in name for name in names), names
        assert all(creator_alive(name) for name in names)
        reap_orphaned_segments()
        assert names <= set(list_segments(os.getpid()))
        receiver = WeightReceiver(ModelDescription.from_hf_config(CONFIG))
        copied = dict(receiver.apply(manifest))
        assert all(torch.equal(copied[name], params[name]) for name in params)
        receiver.close()
        assert names <= set(list_segments(os.getpid()))
    finally:
        publisher.close()


def test_reader_that_cannot_read_the_start_time_goes_by_the_pid(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from podrl.weights.protocol import SharedSegment, creator_alive, reap_orphaned_segments

    segment = SharedSegment(4096)  # its name carries this process's real start time
    try:
        assert "-unknown-" not in segment.name
        _unreadable_proc(monkeypatch, tmp_path)
        assert creator_alive(segment.name)
        reap_orphaned_segments()
        assert segment.name in list_segments(os.getpid())
    finally:
        segment.unlink()


def test_segment_of_a_dead_creator_with_unknown_start_time_is_reaped(tmp_path: Path) -> None:
    from podrl.weights.protocol import creator_alive, reap_orphaned_segments

    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(finished.stdout)
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    name = f"podrl-w-{dead_pid}-unknown-0123456789ab"
    (shm_dir / name).write_bytes(b"\0" * 64)
    assert not creator_alive(name)
    assert reap_orphaned_segments(shm_dir) == [name]
    assert not (shm_dir / name).exists()
