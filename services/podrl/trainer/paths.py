"""Where the trainer's file RPCs may write and read: under the run directory or a folder the
run config names (``trainer.checkpoint_dir``, ``trainer.export_dir``), never elsewhere.

SaveCheckpoint, LoadCheckpoint and ExportHF take a path from the caller. The controller's
credentials travel in plain gRPC metadata (docs/security.md), so whoever holds them must not be
able to make the trainer create, replace or read folders anywhere its user may write
(``/etc/x``, ``../../x``, ``/proc/self/cwd/x``). A requested path is resolved as the process
would open it (relative to the trainer's working directory, as before), then to its real path:
``..`` is applied and every symlink among its existing components is followed, so a symlink
inside the run directory that points outside it resolves outside and is refused. The real path
must lie strictly under the real path of an allowed root, and the RPC then works on that real
path (not on the name the caller sent).

What stays possible: a process that can create symlinks inside the run directory between the
check and the write could redirect it; that process can already write there itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


class PathNotAllowedError(ValueError):
    """A requested path outside every allowed root; the message names the field and roots."""


def real_path(path: Path) -> Path:
    """``path`` made absolute against the working directory, ``..`` applied and every symlink
    among its existing components followed."""
    return Path(os.path.realpath(Path(path).absolute()))


def confined(requested: str | Path, roots: Sequence[tuple[str, Path]], field: str) -> Path:
    """The real path of ``requested`` if it lies strictly under the real path of one of
    ``roots`` (pairs of the config field that names the root, and the root); raises
    PathNotAllowedError naming ``field`` and the allowed roots otherwise."""
    allowed = ", ".join(f"{name} ({real_path(root)})" for name, root in roots)
    try:
        path = real_path(Path(requested))
    except (ValueError, OSError) as err:  # an embedded NUL byte, a name too long
        raise PathNotAllowedError(
            f"{field}: {str(requested)[:200]!r} is not a path ({err})"
        ) from None
    for _, root in roots:
        base = real_path(root)
        if path != base and path.is_relative_to(base):
            return path
    raise PathNotAllowedError(
        f"{field}: {str(requested)[:200]!r} resolves to {str(path)[:200]}, outside the folders "
        f"the trainer may use: {allowed}; give a path under one of them"
    )
