"""Structured logging: one JSON object per line (or plain text for humans)."""

from __future__ import annotations

import logging
import sys

from pythonjsonlogger.json import JsonFormatter

from podrl.config.run_config import LogConfig


class _ContextFilter(logging.Filter):
    """Stamps every record with the service and worker it came from."""

    def __init__(self, service: str, worker_id: str) -> None:
        super().__init__()
        self.service = service
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        record.worker_id = self.worker_id
        return True


def setup_logging(config: LogConfig, service: str, worker_id: str) -> None:
    """Route the root logger to stderr in the configured format."""
    handler = logging.StreamHandler(sys.stderr)
    if config.format == "json":
        handler.setFormatter(
            JsonFormatter(
                "{asctime}{levelname}{name}{service}{worker_id}{message}",
                style="{",
                rename_fields={"levelname": "level", "asctime": "time", "name": "logger"},
            )
        )
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(service)s %(name)s: %(message)s")
        )
    handler.addFilter(_ContextFilter(service, worker_id))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(config.level)
