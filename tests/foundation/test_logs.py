"""Log lines name their service and worker; no podrl code runs per record (podrl.common.logs)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from podrl.common.logs import setup_logging
from podrl.config.transport import LogConfig


@pytest.fixture(autouse=True)
def _restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("form", ["json", "text"])
def test_a_line_names_its_service_and_worker_with_no_podrl_code_per_record(
    form: str, capsys: pytest.CaptureFixture[str]
) -> None:
    setup_logging(LogConfig(format=form), "grader", "pod-0")
    handler = logging.getLogger().handlers[0]
    # Only the standard library and the JSON formatter handle a record: a step that logs runs
    # nothing of podrl.common.logs (docs/architecture.md counts the files a step runs).
    assert handler.filters == []
    assert type(handler.formatter).__module__.split(".")[0] in ("logging", "pythonjsonlogger")
    logging.getLogger("podrl.test").info("hello")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    if form == "json":
        fields = json.loads(line)
        assert (fields["service"], fields["worker_id"]) == ("grader", "pod-0")
        assert (fields["level"], fields["logger"], fields["message"]) == (
            "INFO",
            "podrl.test",
            "hello",
        )
    else:
        assert line.endswith(" INFO grader podrl.test: hello")
