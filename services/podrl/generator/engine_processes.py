"""vLLM's processes and shared memory die with the generator, even after ``kill -9``.

vLLM runs its engine core (and, with tensor parallelism, its workers) in processes of its own,
and they talk through POSIX shared memory (``/dev/shm/psm_*``, Python's ``SharedMemory``). A
generator killed with SIGKILL cannot shut them down, and they used to live on under pid 1
(1.6 GB of processes, 420 MB of segments), also through the next run. Three things stop that:

* **parent-death signals**: a process the generator forks (vLLM's engine core on GPUs)
  asks the kernel for SIGKILL when the generator ends (Linux ``PR_SET_PDEATHSIG``, an at-fork
  hook: :func:`children_die_with_generator`); every vLLM worker does the same for its own
  parent when the engine starts (:func:`die_with_generator`, from the worker extension). A
  spawned engine core (vLLM spawns on CPU) runs no podrl code, so its workers watch the
  generator (a pidfd) and SIGKILL the engine core when the generator is gone;
* **process groups**: ``podrl up`` starts each service as the leader of a process group of its
  own, which vLLM's processes inherit, and kills what is left of the group when it stops;
* **a record of vLLM's segments**: once the engine runs, the generator writes the names of the
  ``psm_*`` segments its process tree holds to ``/dev/shm/podrl-vllm-<pid>-<start>`` (it
  removes that record when it shuts down cleanly). Every generator start, and ``podrl up``
  when it stops, unlinks the recorded segments of generators that no longer run, unless a
  running process still maps or holds one (:func:`reap_dead_engine_segments`).

* **a socket folder of its own**: vLLM's processes talk over ZeroMQ ``ipc://`` sockets, files
  in ``VLLM_RPC_BASE_PATH`` (the temporary folder by default) that a killed process never
  removes (hundreds piled up in the temporary folder over a day of test runs). The generator points
  ``VLLM_RPC_BASE_PATH`` at ``<tmp>/podrl-vllm-<pid>-<start>`` (:func:`own_socket_dir`; a
  value the user set is kept), removes it when it shuts down, and every generator start and
  ``podrl up`` remove those of generators that no longer run (:func:`reap_dead_socket_dirs`).

Only names recorded by a podrl generator are ever unlinked: ``psm_*`` segments of other
programs carry no creator and are never touched. Imports neither torch nor vLLM (``podrl up``
uses it).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import re
import select
import shutil
import signal
import stat
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

from podrl.generator.vllm_compat import RPC_BASE_PATH_ENV

log = logging.getLogger(__name__)

# As in podrl.weights.protocol, which imports torch; this module must not (podrl up imports it).
SHM_DIR = Path("/dev/shm")
PROC_DIR = Path("/proc")
SOCKET_DIR_ENV = RPC_BASE_PATH_ENV
UNKNOWN_START = "unknown"

RECORD_PREFIX = "podrl-vllm-"
VLLM_SEGMENT_PREFIX = "psm_"
_RECORD_RE = re.compile(rf"^{RECORD_PREFIX}(\d+)-(\d+|{UNKNOWN_START})$")
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` to this process when its parent (the thread that started
    it) ends."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))


def die_with_generator(generator_pid: int) -> None:
    """In a vLLM worker: die with the parent; when the parent is not the generator itself but
    vLLM's engine core, also SIGKILL the engine core (and so this worker) once the generator
    ends (a daemon thread waits on a pidfd of the generator; no polling)."""
    if generator_pid == os.getpid():
        return  # the engine core runs in the generator itself (generator.engine_core)
    die_with_parent()
    engine_core = os.getppid()
    if engine_core == generator_pid:
        return  # the kernel's parent-death signal covers it
    try:
        generator = os.pidfd_open(generator_pid)
    except ProcessLookupError:
        os.kill(engine_core, signal.SIGKILL)
        return

    def kill_engine_core_when_the_generator_ends() -> None:
        select.select([generator], [], [])
        log.warning("the generator (pid %d) ended: stopping vLLM's engine core", generator_pid)
        os.kill(engine_core, signal.SIGKILL)  # this worker follows by its parent-death signal

    threading.Thread(
        target=kill_engine_core_when_the_generator_ends,
        name="podrl-die-with-generator",
        daemon=True,
    ).start()


_fork_hook_installed = False


def children_die_with_generator() -> None:
    """From now on every process this one forks (vLLM's engine core) is SIGKILLed when the
    thread that forked it ends (the engine's loop thread lives until the engine shuts down)."""
    global _fork_hook_installed
    if not _fork_hook_installed:
        os.register_at_fork(after_in_child=die_with_parent)
        _fork_hook_installed = True


# ---- the process tree and the segments it holds ---------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (after the command name, which may hold spaces)."""
    try:
        stat = (PROC_DIR / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def _process_start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[1])


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir(PROC_DIR) if name.isdigit()]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), as /proc shows them now."""
    children: dict[int, list[int]] = {}
    for other in _all_pids():
        parent = _parent_of(other)
        if parent is not None:
            children.setdefault(parent, []).append(other)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _shm_names_of(pid: int, shm_dir: Path) -> set[str]:
    """Names of files in ``shm_dir`` that ``pid`` maps or holds open (empty where /proc does
    not let us look)."""
    prefix = f"{shm_dir}/"
    names: set[str] = set()
    with contextlib.suppress(OSError):
        for line in (PROC_DIR / str(pid) / "maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
            if path.startswith(prefix):
                names.add(path[len(prefix) :].removesuffix(" (deleted)"))
    with contextlib.suppress(OSError):
        for fd in os.listdir(PROC_DIR / str(pid) / "fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(PROC_DIR / str(pid) / "fd" / fd)
                if target.startswith(prefix):
                    names.add(target[len(prefix) :].removesuffix(" (deleted)"))
    return names


def held_segments(pids: Iterable[int], shm_dir: Path = SHM_DIR) -> set[str]:
    """vLLM segment names (``psm_*``) that any of ``pids`` maps or holds open."""
    names: set[str] = set()
    for pid in pids:
        names |= _shm_names_of(pid, shm_dir)
    return {name for name in names if name.startswith(VLLM_SEGMENT_PREFIX)}


# ---- the record ---------------------------------------------------------------------------


def _generator_name(pid: int | None = None) -> str:
    """``podrl-vllm-<pid>-<start>``: names a generator process (its record, its socket
    folder), so that a later one can tell whether it still runs."""
    pid = os.getpid() if pid is None else pid
    start = _process_start_time(pid)
    return f"{RECORD_PREFIX}{pid}-{UNKNOWN_START if start is None else start}"


def _entries_of_dead_generators(directory: Path) -> list[str]:
    """The entries of ``directory`` named by :func:`_generator_name` for a process that no
    longer runs."""
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    dead = []
    for entry in entries:
        match = _RECORD_RE.match(entry)
        if match and not _creator_alive(int(match.group(1)), match.group(2)):
            dead.append(entry)
    return dead


def record_path(pid: int | None = None, shm_dir: Path = SHM_DIR) -> Path:
    return shm_dir / _generator_name(pid)


def record_engine_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Write the ``psm_*`` names this process and its descendants hold to this generator's
    record (replacing an earlier one); returns them."""
    me = os.getpid()
    names = sorted(held_segments([me, *descendants(me)], shm_dir))
    path = record_path(me, shm_dir)
    fresh = path.with_name(f".{path.name}.tmp")
    descriptor = os.open(fresh, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as out:
        json.dump(names, out)
    os.replace(fresh, path)
    return names


def forget_engine_segments(shm_dir: Path = SHM_DIR) -> None:
    """The engine shut down cleanly (its segments are gone): drop this generator's record."""
    record_path(shm_dir=shm_dir).unlink(missing_ok=True)


def _creator_alive(pid: int, start: str) -> bool:
    if not _pid_running(pid):
        return False
    running = _process_start_time(pid)
    return start == UNKNOWN_START or running is None or str(running) == start


def reap_dead_engine_segments(shm_dir: Path = SHM_DIR) -> list[str]:
    """Unlink the recorded ``psm_*`` segments of generators that no longer run (keeping any a
    running process still maps or holds) and their records; returns the names unlinked."""
    dead = [shm_dir / entry for entry in _entries_of_dead_generators(shm_dir)]
    if not dead:
        return []
    in_use = held_segments(_all_pids(), shm_dir)
    removed = []
    for record in dead:
        try:
            names = json.loads(record.read_text())
        except (OSError, ValueError):
            names = []
        for name in names:
            if not isinstance(name, str) or "/" in name or name in in_use:
                continue
            if not name.startswith(VLLM_SEGMENT_PREFIX):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shm_dir / name)
                removed.append(name)
        record.unlink(missing_ok=True)
    if removed:
        log.info("unlinked %d shared-memory segments of killed vLLM engines", len(removed))
    return removed


# ---- vLLM's ZeroMQ socket files -------------------------------------------------------------


def socket_dir_path(pid: int | None = None, tmp_dir: Path | None = None) -> Path:
    """This generator's folder for vLLM's ``ipc://`` socket files."""
    tmp_dir = Path(tempfile.gettempdir()) if tmp_dir is None else tmp_dir
    return tmp_dir / _generator_name(pid)


def own_socket_dir(
    environ: dict[str, str] | os._Environ[str] | None = None, tmp_dir: Path | None = None
) -> Path | None:
    """Create this generator's socket folder (mode 0700) and point ``VLLM_RPC_BASE_PATH`` at
    it, unless the variable names another folder (then None: the user's folder is theirs).
    An engine started again in this process finds its own path there and gets it back."""
    environ = os.environ if environ is None else environ
    path = socket_dir_path(tmp_dir=tmp_dir)
    if environ.get(SOCKET_DIR_ENV, str(path)) != str(path):
        return None
    path.mkdir(mode=0o700, exist_ok=True)
    environ[SOCKET_DIR_ENV] = str(path)
    return path


def remove_socket_dir(path: Path | None) -> None:
    """The engine shut down: its socket folder goes (a folder this generator created)."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def reap_dead_socket_dirs(tmp_dir: Path | None = None) -> list[str]:
    """Remove the socket folders of generators that no longer run: real folders (never a
    symlink) of this user named as :func:`socket_dir_path` names them. Returns their names."""
    tmp_dir = Path(tempfile.gettempdir()) if tmp_dir is None else tmp_dir
    removed = []
    for entry in _entries_of_dead_generators(tmp_dir):
        path = tmp_dir / entry
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(entry)
    if removed:
        log.info("removed %d socket folders of killed vLLM engines", len(removed))
    return removed
