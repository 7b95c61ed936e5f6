"""Records when each file of ``services/podrl/`` runs code, per process and thread.

tests/harness/walk.py copies this file as ``sitecustomize.py`` into a folder on the
``PYTHONPATH`` of every service process it starts, so Python imports it at start-up, before
any thread or podrl module exists. It does nothing unless ``WALK_RECORDER_DIR`` is set. Then
``sys.setprofile`` and ``threading.setprofile`` (every thread started later, pools included)
see each function call; a call of a function whose code lives under ``WALK_RECORDER_ROOT`` (the
podrl package folder; its generated stubs ``v1/`` excepted) extends the time span of its file
in the calling thread. Module and class bodies (run once, at import) are not counted: they
are no function run on a path. Methods that ``dataclasses`` and ``namedtuple`` generate have
the file name ``<string>``: they count for the file of the class that owns them, so building
a dataclass counts its module (docs/architecture.md's rule). What is never seen: a class built
without running any code of its own (an Enum member, a pydantic model without validators, a
class without ``__init__``), and code the interpreter runs without a Python frame.

``WALK_RECORDER_MARKERS`` (``Class.method,...``: qualified names, wherever their file is) names
podrl functions whose every call and return is stored with its time and thread: walk.py cuts
the step and the sync out of the run with them.
Each process writes ``<WALK_RECORDER_DIR>/<pid>.json`` twice a second and at exit (a process
killed without exit keeps its last write); a forked child starts afresh under its own pid.

Standard library only: it runs before anything else is importable.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from types import CodeType, FrameType
from typing import Any

#: Calls of one file in one thread closer than this (seconds) share a span: spans stay few,
#: and a span overlaps a window of more than this length only if a call fell inside it.
GAP = 0.002
_CO_OPTIMIZED = 0x1  # set on function code, unset on module and class bodies
#: A comprehension runs inside the code that defines it, which counts its file already (or is
#: a module body at import, which does not): on its own it would count an import.
_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
_MISS = object()

_root = ""
_dir = ""
_markers: set[str] = set()
_where: dict[CodeType, Any] = {}
"""code → its file (relative to the root), or None when it is not counted."""
_marker_of: dict[CodeType, str] = {}
_spans: dict[tuple[str, str], list[float]] = {}
"""(file, thread name) → [start, end, start, end, ...] of its calls."""
_marks: list[tuple[str, str, float, str]] = []
"""(marker, "call" or "return", time, thread name)."""
_local = threading.local()
_now = time.monotonic  # CLOCK_MONOTONIC: one clock for every process of the machine


def _owner_file(code: CodeType, frame: FrameType) -> str | None:
    """The file of the class whose generated method ``code`` is (its first argument is the
    instance, or the class for ``__new__``)."""
    if not code.co_varnames:
        return None
    first = frame.f_locals.get(code.co_varnames[0])
    cls = first if isinstance(first, type) else type(first)
    owner = cls
    for klass in cls.__mro__:  # the class that defines it, not a subclass that inherits it
        if any(getattr(v, "__code__", None) is code for v in vars(klass).values()):
            owner = klass
            break
    module = sys.modules.get(owner.__module__)
    return getattr(module, "__file__", None)


def _resolve(code: CodeType, frame: FrameType) -> str | None:
    filename = code.co_filename
    if filename == "<string>":
        filename = _owner_file(code, frame) or ""
    elif not code.co_flags & _CO_OPTIMIZED or code.co_name in _COMPREHENSIONS:
        filename = ""  # a module or class body: import time
    if not filename.startswith(_root):
        return None
    relative = filename[len(_root) :]
    if relative.startswith("v1/"):
        return None
    return relative


def _thread_name() -> str:
    name = getattr(_local, "name", None)
    if name is None:
        name = _local.name = threading.current_thread().name
    return name


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call":
        code = frame.f_code
        relative = _where.get(code, _MISS)
        if relative is _MISS:
            relative = _where[code] = _resolve(code, frame)
            if relative is not None and code.co_qualname in _markers:
                _marker_of[code] = code.co_qualname
        if relative is None:
            return
        now = _now()
        key = (relative, _thread_name())
        spans = _spans.get(key)
        if spans is None:
            _spans[key] = [now, now]
        elif now - spans[-1] < GAP:
            spans[-1] = now
        else:
            spans += (now, now)
        if code in _marker_of:
            _marks.append((_marker_of[code], "call", now, key[1]))
    elif event == "return" and frame.f_code in _marker_of:
        _marks.append((_marker_of[frame.f_code], "return", _now(), _thread_name()))


def dump() -> None:
    """Write what this process recorded (a new file renamed over the old one)."""
    spans: dict[str, dict[str, list[float]]] = {}
    for (relative, thread), times in list(_spans.items()):
        spans.setdefault(relative, {})[thread] = list(times)
    record = {"pid": os.getpid(), "argv": sys.argv, "spans": spans, "marks": list(_marks)}
    path = os.path.join(_dir, f"{os.getpid()}.json")
    fresh = f"{path}.tmp"
    with open(fresh, "w") as out:
        json.dump(record, out)
    os.replace(fresh, path)


def _dump_every_half_second() -> None:
    sys.setprofile(None)  # the writer is no part of any path
    while True:
        time.sleep(0.5)
        with contextlib.suppress(Exception):  # a failed write must never stop the service
            dump()


def _start_writer() -> None:
    threading.Thread(target=_dump_every_half_second, name="walk-recorder", daemon=True).start()


def _after_fork() -> None:
    _spans.clear()
    _marks.clear()
    _start_writer()


def install(root: str, folder: str, markers: str) -> None:
    global _root, _dir
    _root = os.path.join(os.path.realpath(root), "")
    _dir = folder
    _markers.update(m for m in markers.split(",") if m)
    os.makedirs(folder, exist_ok=True)
    atexit.register(dump)
    os.register_at_fork(after_in_child=_after_fork)
    _start_writer()
    threading.setprofile(_profile)
    sys.setprofile(_profile)


if os.environ.get("WALK_RECORDER_DIR"):
    install(
        os.environ["WALK_RECORDER_ROOT"],
        os.environ["WALK_RECORDER_DIR"],
        os.environ.get("WALK_RECORDER_MARKERS", ""),
    )
