"""``podrl-trainer`` with ``dp_shard * tp > 1`` and no torchrun around it: start the ranks.

Each rank is ``python -m podrl.trainer`` with the torchrun environment (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Rank 0 serves gRPC and drives the
others. SIGTERM/SIGINT to the launcher go to rank 0 only: it drains its RPCs and then tells the
other ranks to stop (they ignore the signal themselves so they are never cut off mid-collective).
If any rank dies, the others are stopped and the launcher exits with that rank's code. Ranks
get SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from podrl.common.processes import die_with_parent, free_port
from podrl.config import RunConfig

log = logging.getLogger(__name__)


def launch_ranks(config: RunConfig, argv: Sequence[str]) -> int:
    """Start ``config.trainer.world_size`` ranks on this host and supervise them."""
    world = config.trainer.world_size
    host = "127.0.0.1"
    port = config.trainer.master_port or free_port(host)
    base = {
        **os.environ,
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": host,
        "MASTER_PORT": str(port),
    }
    command = [sys.executable, "-m", "podrl.trainer", *argv]
    ranks = [
        subprocess.Popen(
            command,
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        for rank in range(world)
    ]
    log.info("started %d trainer ranks (pids %s)", world, [p.pid for p in ranks])
    stopping: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signal.Signals(signum).name)
        if ranks[0].poll() is None:
            ranks[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    grace = config.grpc.shutdown_grace_seconds + 30
    while True:
        codes = [p.poll() for p in ranks]
        if all(code is not None for code in codes):
            break
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            log.error("trainer rank %d exited with %s; stopping the other ranks", rank, code)
            _stop_all(ranks, grace)
            break
        if codes[0] == 0:
            # Rank 0 ends cleanly only after it sent every other rank its shutdown command:
            # they are on their way out; a SIGTERM now would only race their exit.
            _wait_then_stop(ranks[1:], grace)
            break
        time.sleep(0.2)
    codes = [p.returncode for p in ranks]
    bad = [c for c in codes if c]
    return 0 if not bad else (bad[0] if bad[0] > 0 else 1)


def _wait_then_stop(ranks: list[subprocess.Popen[bytes]], grace: float) -> None:
    """Give ranks told to shut down ``grace`` seconds to exit; then stop what is left."""
    deadline = time.monotonic() + grace
    for process in ranks:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("trainer rank pid %d did not exit after rank 0; stopping it", process.pid)
    _stop_all([p for p in ranks if p.poll() is None], grace=5.0)


def _stop_all(ranks: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM rank 0 (it stops the others), then everyone; SIGKILL what outlives ``grace``."""
    deadline = time.monotonic() + grace
    for process in ranks:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in ranks:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
