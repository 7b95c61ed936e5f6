"""Named POSIX shared-memory segments for CPU weights, and the reaper of orphaned ones.

A segment is ``/dev/shm/<name>`` (what ``shm_open`` uses on Linux) with the name
``podrl-w-<creator pid>-<creator start time>-<random>``. The creator unlinks its segments when
it closes them or exits (atexit, SIGTERM through the service's normal shutdown). A creator killed
with ``kill -9`` cannot, so both sides call :func:`reap_orphaned_segments` when they start and
when they close: it unlinks every podrl segment whose creator (pid *and* start time, so a reused
pid does not keep garbage alive) no longer runs. That needs one PID namespace for trainer and
generator, which the pod has anyway (``shareProcessNamespace: true``; CUDA IPC needs it too).

Where ``/proc/<pid>/stat`` cannot be read, the start time is unknown, never guessed: the
creator writes ``unknown`` in the name, and a reader that cannot read a creator's start time
goes by the pid alone. Such a segment counts as alive while its pid runs (a reused pid may
then keep it until that process ends); it is never reaped or refused on a guess.

Readers map segments read-only, so a generator can never write into the trainer's memory, and
open them only as regular files (no symlink is followed) of the trainer's user with exactly the
size the manifest declares.
"""

from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import re
import secrets
import stat
import threading
import warnings
from pathlib import Path

import torch

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "podrl-w-"
UNKNOWN_START = "unknown"
_NAME_RE = re.compile(rf"^podrl-w-(\d+)-(\d+|{UNKNOWN_START})-[0-9a-f]+$")
PROC_DIR = Path("/proc")
# Tensors inside a segment start at multiples of this (cache line; any dtype is aligned).
ALIGNMENT = 64


def _process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat); None
    when it cannot be read (process gone, /proc missing or restricted)."""
    try:
        stat = (PROC_DIR / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def _pid_running(pid: int) -> bool:
    """Whether a process ``pid`` exists in this PID namespace (no /proc needed)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def segment_name(pid: int | None = None) -> str:
    """A fresh segment name owned by ``pid`` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    start = _process_start_time(pid)
    start_field = UNKNOWN_START if start is None else str(start)
    return f"{SEGMENT_PREFIX}{pid}-{start_field}-{secrets.token_hex(6)}"


def segment_creator(name: str) -> tuple[int, int | None] | None:
    """(pid, start time or None where the creator could not read it) encoded in a podrl
    segment name, or None for other names."""
    match = _NAME_RE.match(name)
    if match is None:
        return None
    start = match.group(2)
    return int(match.group(1)), None if start == UNKNOWN_START else int(start)


def creator_alive(name: str) -> bool:
    """Whether the process that created segment ``name`` still runs: same pid and start time;
    by the pid alone where either start time is unknown."""
    creator = segment_creator(name)
    if creator is None:
        return False
    pid, start = creator
    if not _pid_running(pid):
        return False
    running_start = _process_start_time(pid)
    if start is None or running_start is None:
        return True
    return running_start == start


def reap_orphaned_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink podrl segments whose creator process is gone; returns the names removed."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        if segment_creator(name) is None or creator_alive(name):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(shm_dir / name)
            removed.append(name)
    return removed


def list_segments(pid: int | None = None, shm_dir: Path = SHM_DIR) -> list[str]:
    """podrl segment names present now (of one creator pid if given)."""
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        creator = segment_creator(name)
        if creator is not None and (pid is None or creator[0] == pid):
            out.append(name)
    return sorted(out)


class SharedSegment:
    """One segment this process created: a writable byte tensor over it, unlinked on close."""

    def __init__(self, nbytes: int, shm_dir: Path = SHM_DIR) -> None:
        self.name = segment_name()
        self.nbytes = max(int(nbytes), 1)
        self._path = shm_dir / self.name
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._mmap = mmap.mmap(
                fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.unlink(self._path)
            raise
        finally:
            os.close(fd)
        self.data = torch.frombuffer(self._mmap, dtype=torch.uint8)
        _register(self)

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A contiguous tensor of ``dtype``/``shape`` at byte ``offset`` of the segment."""
        count = 1
        for size in shape:
            count *= size
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        return self.data[offset : offset + nbytes].view(dtype).view(shape)

    def unlink(self) -> None:
        """Remove the name (readers that mapped it keep their mapping until they close it)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._path)
        _unregister(self)


class UnsafeSegmentError(OSError):
    """A file under a podrl segment name that is not what the trainer creates: not a regular
    file, another user's, or not of the declared size."""


_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def open_segment_readonly(
    name: str,
    shm_dir: Path = SHM_DIR,
    *,
    nbytes: int | None = None,
    owner_uid: int | None = None,
) -> torch.Tensor:
    """Map an existing segment read-only as a uint8 tensor (FileNotFoundError if it is gone).

    Opened without following symlinks (and without blocking on a FIFO); the file must be a
    regular file owned by ``owner_uid`` (default: this process's user) and, when ``nbytes``
    is given, exactly that large; anything else raises :class:`UnsafeSegmentError` (or the
    open's own OSError, e.g. ELOOP for a symlink). The mapping lives as long as the returned
    tensor (and its views) does.
    """
    if segment_creator(name) is None or "/" in name:
        raise FileNotFoundError(f"not a podrl shared-memory segment name: {name!r}")
    fd = os.open(shm_dir / name, _OPEN_FLAGS)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeSegmentError(f"{name} is not a regular file")
        expected_owner = os.geteuid() if owner_uid is None else owner_uid
        if info.st_uid != expected_owner:
            raise UnsafeSegmentError(
                f"{name} belongs to uid {info.st_uid}, not to the trainer's user {expected_owner}"
            )
        size = info.st_size
        if nbytes is not None and size != nbytes:
            raise UnsafeSegmentError(f"{name} holds {size} bytes, the manifest declares {nbytes}")
        if size == 0:
            raise UnsafeSegmentError(f"{name} is empty")
        mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable: that is the point (read-only mapping).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


_LIVE: dict[str, SharedSegment] = {}
_LIVE_LOCK = threading.Lock()


def _register(segment: SharedSegment) -> None:
    with _LIVE_LOCK:
        _LIVE[segment.name] = segment


def _unregister(segment: SharedSegment) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(segment.name, None)


@atexit.register
def unlink_all_segments() -> None:
    """Unlink every segment this process still owns (runs at interpreter exit)."""
    with _LIVE_LOCK:
        # A forked child inherits this registry and atexit hook; only the creator unlinks.
        segments = [s for s in _LIVE.values() if segment_creator(s.name)[0] == os.getpid()]
    for segment in segments:
        segment.unlink()
