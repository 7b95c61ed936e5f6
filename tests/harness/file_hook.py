"""An in-process ``sys.setprofile`` hook that notes which files of one package run.

The fast path tests (tests/controller/test_step_files.py, tests/generator/test_path_files.py)
install it on the threads they drive; the slow recorded walk (tests/harness/walk.py) records
whole service processes with tests/harness/call_recorder.py instead, which must stay standard
library only because it runs as their ``sitecustomize``."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

ProfileHook = Callable[[FrameType, str, Any], None]

_LOCK = threading.Lock()


def file_hook(root: Path, *sets: set[str]) -> ProfileHook:
    """A profile hook adding the path, relative to ``root``, of the file of every Python
    function called below ``root`` to each of ``sets``."""

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        path = Path(frame.f_code.co_filename)
        if root in path.parents:
            name = path.relative_to(root).as_posix()
            with _LOCK:
                for files in sets:
                    files.add(name)

    return profile
