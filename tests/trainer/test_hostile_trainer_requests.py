"""Hostile requests with the controller's credentials against the real trainer service
(`python -m podrl.trainer`, 2 FSDP2 gloo ranks): file RPCs confined to the run directory,
exports that never delete files podrl did not write, acknowledgements of versions that are
not pending refused, and a full disk during a checkpoint save reported with every rank alive."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from podrl.trainer import checkpoint
from podrl.trainer.export import EXPORT_RECORD
from podrl.v1 import common_pb2, trainer_pb2
from tests.trainer.pods import fault_plan
from tests.trainer.rank_worker import make_request
from tests.trainer.service_process import trainer_service

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    run_dir = tmp / "run"
    run_dir.mkdir()
    with trainer_service(tiny_model, run_dir, timeout=120) as (process, stub):
        yield process, stub, run_dir, tmp


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def _tree(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def test_file_rpcs_are_confined_to_the_run_dir(service) -> None:
    """SaveCheckpoint, LoadCheckpoint and ExportHF with paths outside the run directory
    (absolute, a ``..`` escape, a symlink inside the run directory pointing out, the trainer's
    /proc/self/cwd) are INVALID_ARGUMENT naming the field and the root, and create nothing."""
    _, stub, run_dir, tmp = service
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "precious.safetensors").write_bytes(b"user data")
    (run_dir / "link").symlink_to(outside, target_is_directory=True)
    depth = len(Path(os.path.relpath(run_dir, "/")).parts)
    escapes = {
        "absolute": str(outside / "x"),
        "dot-dot": str(run_dir / ".." / "outside" / "x"),
        "relative": "../" * (depth + 3) + str(outside / "x").lstrip("/"),
        "symlink": str(run_dir / "link" / "x"),
        "proc-cwd": "/proc/self/cwd/podrl-escape-x",
        "the run dir itself": str(run_dir),
        "a NUL byte": str(run_dir / "a\0b"),
    }
    before = _tree(outside)
    cwd_before = sorted(os.listdir(os.getcwd()))
    calls = {
        "SaveCheckpointRequest.path": lambda p: stub.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path=p), timeout=60
        ),
        "ExportHFRequest.path": lambda p: stub.ExportHF(
            trainer_pb2.ExportHFRequest(path=p), timeout=60
        ),
        "LoadCheckpointRequest.path": lambda p: stub.LoadCheckpoint(
            trainer_pb2.LoadCheckpointRequest(path=p), timeout=60
        ),
    }
    for field, call in calls.items():
        for name, path in escapes.items():
            code, details = _code(lambda c=call, p=path: c(p))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, name, details)
            assert details.startswith(field), (name, details)
            if name != "a NUL byte":
                assert f"run_dir ({run_dir.resolve()})" in details, (name, details)
    assert _tree(outside) == before  # nothing created, nothing deleted
    assert sorted(os.listdir(os.getcwd())) == cwd_before
    # A real checkpoint outside is not loaded either.
    saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
    shutil.copytree(saved.path, outside / "ckpt")
    code, _ = _code(
        lambda: stub.LoadCheckpoint(
            trainer_pb2.LoadCheckpointRequest(path=str(outside / "ckpt")), timeout=60
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    # A save never replaces a folder that is not a checkpoint (the checkpoint directory here).
    code, details = _code(
        lambda: stub.SaveCheckpoint(
            trainer_pb2.SaveCheckpointRequest(path=str(run_dir / "checkpoints")), timeout=60
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "is not a podrl checkpoint" in details
    assert checkpoint.is_checkpoint(Path(saved.path))
    # Paths under the run directory work, relative ones against the working directory.
    mine = stub.SaveCheckpoint(
        trainer_pb2.SaveCheckpointRequest(path=os.path.relpath(run_dir / "mine" / "ckpt")),
        timeout=120,
    )
    assert mine.path == str((run_dir / "mine" / "ckpt").resolve())
    stub.LoadCheckpoint(trainer_pb2.LoadCheckpointRequest(path=mine.path), timeout=120)


def test_exports_never_delete_files_podrl_did_not_write(service) -> None:
    """ExportHF into a folder holding a user's files is refused and leaves them; a second
    export into the folder of a first replaces its files and deletes only a file the first
    one wrote that the second does not."""
    _, stub, run_dir, _ = service
    user = run_dir / "user-folder"
    user.mkdir()
    files = {"precious.safetensors": b"weights", "notes.txt": b"notes", "config.json": b"{}"}
    for name, data in files.items():
        (user / name).write_bytes(data)
    code, details = _code(
        lambda: stub.ExportHF(trainer_pb2.ExportHFRequest(path=str(user)), timeout=120)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION, details
    assert "config.json, notes.txt, precious.safetensors" in details
    assert {p.name: p.read_bytes() for p in user.iterdir()} == files

    target = run_dir / "exported"
    first = stub.ExportHF(trainer_pb2.ExportHFRequest(path=str(target)), timeout=120)
    assert "model.safetensors" in first.files and "config.json" in first.files
    # As if the first export had written a second shard the next one does not write.
    stale = "model-00002-of-00002.safetensors"
    (target / stale).write_bytes(b"old shard")
    record = json.loads((target / EXPORT_RECORD).read_text())
    (target / EXPORT_RECORD).write_text(json.dumps({"files": [*record["files"], stale]}))
    second = stub.ExportHF(trainer_pb2.ExportHFRequest(path=str(target)), timeout=120)
    assert list(second.files) == list(first.files)
    assert sorted(p.name for p in target.iterdir()) == sorted([*first.files, EXPORT_RECORD])
    assert not any(p.name.endswith(".export") for p in run_dir.iterdir())  # staging removed


def test_acknowledgements_of_versions_not_pending_are_refused(service) -> None:
    """AcknowledgeWeights of a version never published (2^64-1, 999) or not the pending one is
    FAILED_PRECONDITION naming the pending version, and releases nothing; the pending
    version's, a repeat of the last acknowledged one and, with nothing pending, the trainer's
    own version are answered."""
    _, stub, _, _ = service

    def ack(version: int, generator_id: str = "controller") -> None:
        stub.AcknowledgeWeights(
            trainer_pb2.AcknowledgeWeightsRequest(version=version, generator_id=generator_id),
            timeout=30,
        )

    version = stub.Info(common_pb2.InfoRequest(), timeout=10).policy_version
    ack(version)  # nothing pending: the controller's align acknowledges the trainer's version
    for bogus in (2**64 - 1, 999):
        code, details = _code(lambda b=bogus: ack(b))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert details.startswith(f"AcknowledgeWeightsRequest.version: {bogus} is not the pending")
        assert "pending: none" in details
    stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    for bogus in (2**64 - 1, 999, version + 1):
        code, details = _code(lambda b=bogus: ack(b))
        assert code == grpc.StatusCode.FAILED_PRECONDITION, details
        assert f"pending: {version}" in details
    # Nothing was released: the next version may not be published over the pending one.
    stub.Train(make_request(11, version=version), timeout=120)
    code, details = _code(
        lambda: stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"version {version} is not acknowledged" in details
    ack(version, generator_id="")  # the pending one (generator_id is not read)
    ack(version, generator_id="g" * 1_000_000)  # a retry of it
    published = stub.PublishWeights(trainer_pb2.PublishWeightsRequest(), timeout=60)
    assert published.manifest.version == version + 1
    ack(version)  # a late retry of the older one releases nothing
    code, _ = _code(lambda: ack(version + 7))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    ack(version + 1)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 MB tmpfs (about three checkpoints of the tiny model at 2 ranks)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` up to ``leave`` free bytes with one file."""
    filler = disk / "filler"
    with open(filler, "ab") as out:
        while True:
            stats = os.statvfs(disk)
            free = stats.f_bavail * stats.f_frsize - leave
            if free <= 0:
                return filler
            try:
                out.write(b"\0" * min(free, 1 << 20))
                out.flush()
            except OSError:
                return filler


def test_a_full_disk_fails_the_save_on_every_rank_and_the_next_one_works(
    tiny_model, tmp_path: Path, small_disk: Path
) -> None:
    """A disk that fills while the ranks write their shards: RESOURCE_EXHAUSTED with the
    errno text at once, no partial folder, the previous checkpoint intact, both ranks alive
    and serving; a disk already too full is refused before writing; once space is freed the
    next save works. A save that fails on one rank only fails on every rank alike."""
    # The second save waits 4 s before the ranks write (the test fills the disk meanwhile);
    # the fourth that reaches the point (the fifth save: the third is refused before it)
    # fails on rank 1 only.
    faults = fault_plan(
        {"point": "trainer.checkpoint_before_write", "action": "delay", "seconds": 4, "skip": 1},
        {"point": "trainer.checkpoint_before_write", "action": "raise", "rank": 1, "skip": 3},
    )
    env = {**faults, "PODRL_TRAINER__CHECKPOINT_DIR": str(small_disk)}
    with trainer_service(tiny_model, tmp_path, timeout=120, extra_env=env) as (process, stub):
        first = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
        stub.Train(make_request(1), timeout=120)

        filler: list[Path] = []

        def fill_when_the_save_starts() -> None:
            deadline = time.monotonic() + 60
            while not (small_disk / ".step-00000001.partial").exists():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            filler.append(_fill(small_disk))

        filling = threading.Thread(target=fill_when_the_save_starts)
        filling.start()
        started = time.monotonic()
        code, details = _code(
            lambda: stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
        )
        filling.join()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "No space left on device" in details and "rank 0" in details, details
        assert time.monotonic() - started < 30
        assert sorted(p.name for p in small_disk.iterdir()) == ["filler", Path(first.path).name]
        assert checkpoint.is_checkpoint(Path(first.path))
        assert len(psutil.Process(process.pid).children()) == 2  # both ranks alive
        assert stub.Info(common_pb2.InfoRequest(), timeout=10).policy_version == 1

        # Too full from the start: refused before a shard is written.
        filler[0].unlink()
        _fill(small_disk, leave=1 << 20)
        code, details = _code(
            lambda: stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert "No space left on device" in details and "the checkpoint needs about" in details
        assert not list(small_disk.glob(".step-*"))

        # Space freed: the next save works.
        (small_disk / "filler").unlink()
        stub.Train(make_request(2, version=1), timeout=120)
        saved = stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
        assert checkpoint.is_checkpoint(Path(saved.path)) and saved.step == 2

        # Rank 1 fails on its own: both ranks refuse, neither waits for the other.
        code, details = _code(
            lambda: stub.SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(path=str(small_disk / "one-rank")), timeout=120
            )
        )
        assert code == grpc.StatusCode.INTERNAL, details
        assert "rank 0: CheckpointSaveError" in details and "another rank failed" in details
        assert "rank 1: CheckpointSaveError" in details and "InjectedFaultError" in details
        assert not (small_disk / "one-rank").exists()
        assert not list(small_disk.glob(".*"))
        assert stub.Train(make_request(3, version=2), timeout=120).policy_version == 3
