"""``podrl-lighthouse``: the torchft Lighthouse that forms each step's quorum of worker pods.

Every pod's trainer with ``trainer.replication.lighthouse_address`` set is one torchft replica
group; the Lighthouse tells them, step by step, which pods train together (docs/scaling.md,
"Trainers across pods"). It is its own process because torchft imports torch and the
controller must not: ``podrl up`` starts it next to the controller, and in a cluster it runs as
a sidecar container of the controller pod. Its knobs come from the run config
(``trainer.replication``: ``lighthouse_bind``, ``join_timeout_seconds``,
``heartbeat_timeout_seconds``); ``--bind`` overrides the address. It keeps no state worth
keeping: a restarted Lighthouse forms the next quorum from the pods that ask.

torchft's Lighthouse authenticates nobody and serves a status page and a kill endpoint on its
port, so it listens on loopback only (``lighthouse_server_bind``), and the address the trainers
reach (``lighthouse_bind``) is podrl's front (:mod:`podrl.trainer.lighthouse_front`): it
forwards only Quorum and Heartbeat, and only for replica ids that carry the run secret's MAC.

The process logs ``lighthouse listening on <address>`` once both accept connections and stops
on SIGTERM or SIGINT (exit 0).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from podrl.common.auth import load_run_secret
from podrl.common.logs import setup_logging
from podrl.config import ConfigError, load_config
from podrl.config.trainer import ReplicationConfig
from podrl.trainer.lighthouse_front import start_front

log = logging.getLogger(__name__)

# The Lighthouse re-checks a waiting quorum this often (torchft's default).
QUORUM_TICK_MS = 100


def start_lighthouse(settings: ReplicationConfig) -> tuple[object, str]:
    """A running ``torchft`` LighthouseServer on ``settings.lighthouse_server_bind`` (loopback;
    call ``.shutdown()`` to stop) and the host:port its front forwards to.

    Quorums need one pod at least: a pod alone trains alone (the trainer checks that the
    quorum holds the pods its request names)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind=settings.lighthouse_server_bind,
        min_replicas=1,
        join_timeout_ms=int(settings.join_timeout_seconds * 1000),
        quorum_tick_ms=QUORUM_TICK_MS,
        heartbeat_timeout_ms=int(settings.heartbeat_timeout_seconds * 1000),
    )
    # torchft's address() names the machine's hostname; the front dials the loopback host.
    port = server.address().rsplit(":", 1)[1]
    host = settings.lighthouse_server_bind.rsplit(":", 1)[0]
    return server, f"{host}:{port}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="podrl-lighthouse",
        description="Run the torchft Lighthouse of a podrl run (trainers across worker pods).",
    )
    parser.add_argument("--config", help="run config YAML (default: $PODRL_CONFIG or built-ins)")
    parser.add_argument(
        "--bind", help="host:port to listen on (default: trainer.replication.lighthouse_bind)"
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"podrl-lighthouse: {err}", file=sys.stderr)
        return 2
    setup_logging(config.log, "lighthouse", config.worker_id)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("lighthouse: %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    settings = config.trainer.replication
    bind = args.bind or settings.lighthouse_bind
    try:
        secret = load_run_secret(config.auth)
    except ConfigError as err:
        print(f"podrl-lighthouse: {err}", file=sys.stderr)
        return 2
    try:
        server, internal = start_lighthouse(settings)
    except Exception as err:  # e.g. the port is taken: say which, exit like a bad config
        print(
            f"podrl-lighthouse: cannot listen on {settings.lighthouse_server_bind}: {err}; set "
            "trainer.replication.lighthouse_server_bind to a free loopback host:port",
            file=sys.stderr,
        )
        return 2
    try:
        # A Quorum call holds a thread until its quorum forms: one per pod, and heartbeats.
        front, _ = start_front(bind, internal, secret, 2 * config.controller.max_worker_pods + 8)
    except OSError as err:
        server.shutdown()
        print(
            f"podrl-lighthouse: cannot listen on {bind}: {err}; set --bind or "
            "trainer.replication.lighthouse_bind to a free host:port",
            file=sys.stderr,
        )
        return 2
    log.info(
        "lighthouse listening on %s (the torchft Lighthouse on %s, loopback only; replica ids "
        "%s; join timeout %.1f s, heartbeat timeout %.1f s)",
        bind,
        internal,
        "unchecked: auth.disabled" if secret is None else "must carry the run secret's MAC",
        settings.join_timeout_seconds,
        settings.heartbeat_timeout_seconds,
    )
    stop.wait()
    front.stop(grace=1).wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
