"""Files as a handshake between a test and the processes it spawns (trainer ranks, publishers):
one side writes a file atomically, the other waits for it to appear."""

from __future__ import annotations

import time
from pathlib import Path


def wait_for(path: Path, timeout: float = 300.0, poll: float = 0.02) -> None:
    """Return once ``path`` exists; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(poll)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` so that a reader never sees a half-written ``path``."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.rename(path)
