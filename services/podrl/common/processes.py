"""Child-process helpers shared by the local launcher and the trainer's rank launcher."""

from __future__ import annotations

import ctypes
import signal
import socket
from contextlib import ExitStack

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for children: if the parent dies (even by SIGKILL), the kernel sends the
    child SIGTERM, so no service outlives its launcher (Linux ``PR_SET_PDEATHSIG``)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that was free a moment ago (another process may take it before it is
    bound again; :func:`free_ports` for several distinct ones)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free a moment ago (all held open while choosing)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(sock.getsockname()[1])
        return ports
