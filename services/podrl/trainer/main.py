"""``podrl-trainer``: the trainer service, as one process per rank.

* ``dp_shard * tp == 1``: one process, it serves gRPC.
* ``> 1`` under torchrun (RANK set): rank 0 serves gRPC and drives the others; ranks > 0 run
  the rank command loop.
* ``> 1`` without RANK: start the ranks ourselves (``podrl.trainer.launcher``).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

from podrl.common.logs import setup_logging
from podrl.common.service import ServiceSpec, parse_service_args, serve, worker_spec
from podrl.config import RunConfig
from podrl.v1 import trainer_pb2_grpc

log = logging.getLogger(__name__)


def build_spec(config: RunConfig) -> ServiceSpec:
    """Rank 0: the engine, the command loop and the gRPC servicer."""
    from podrl.trainer.engine import TrainerEngine
    from podrl.trainer.servicer import CommandLoop, TrainerServicer, register_commands

    engine = TrainerEngine.build(config)
    loop = CommandLoop.build(config.trainer)
    register_commands(loop, engine)
    spec = worker_spec(
        "trainer",
        config,
        TrainerServicer.build(config, engine, loop),
        trainer_pb2_grpc.add_TrainerServicer_to_server,
        on_close=[loop.shutdown, engine.close],
    )
    spec.details.update({"world_size": str(engine.env.world_size), "device": str(engine.device)})
    spec.policy_version = lambda: engine.policy_version
    return spec


def follow(config: RunConfig) -> int:
    """Ranks > 0: build the same engine, then run rank 0's commands until it says stop."""
    from podrl.trainer.engine import TrainerEngine
    from podrl.trainer.servicer import CommandLoop, register_commands

    rank = int(os.environ["RANK"])

    def on_signal(signum: int, _frame: object) -> None:
        # Leaving mid-collective would hang the others: rank 0 sends "shutdown" when it stops.
        log.info("rank %d: %s, waiting for rank 0 to stop", rank, signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    engine = TrainerEngine.build(config)
    try:
        loop = CommandLoop.build(config.trainer)
        register_commands(loop, engine)
        loop.serve_forever()
    except Exception as err:  # rank 0 gone: the socket error ends the wait
        log.error("rank %d: command loop ended: %s", rank, err)
        return 1
    finally:
        engine.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    config = parse_service_args("trainer", args)
    if config.trainer.world_size > 1 and "RANK" not in os.environ:
        from podrl.trainer.launcher import launch_ranks

        setup_logging(config.log, "trainer", config.worker_id)
        return launch_ranks(config, args)
    if int(os.environ.get("RANK", "0")) == 0:
        return serve("trainer", build_spec, args)
    setup_logging(config.log, "trainer", config.worker_id)
    return follow(config)
