"""Structured logging: one JSON object per line (or plain text for humans).

Every line names the service and worker it came from. Both are fixed for the process, so they
are written into the formatter once, at setup: no code of podrl runs per log record, and a
step's log lines do not bring this file onto the step's path.
"""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from podrl.config.run_config import LogConfig


def setup_logging(config: LogConfig, service: str, worker_id: str) -> None:
    """Route the root logger to stderr in the configured format."""
    handler = logging.StreamHandler(sys.stderr)
    if config.format == "json":
        handler.setFormatter(
            JsonFormatter(
                "{asctime}{levelname}{name}{message}",
                style="{",
                rename_fields={"levelname": "level", "asctime": "time", "name": "logger"},
                static_fields={"service": service, "worker_id": worker_id},
            )
        )
    else:
        # %-style: a literal '%' in the service name must be doubled.
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s %(levelname)s {service.replace('%', '%%')} %(name)s: %(message)s"
            )
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.level)
