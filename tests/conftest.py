"""Suite-wide settings: keep thread pools small (CI has 2 cores) and runs under tmp dirs; one
run secret for every service a test starts (services refuse to start without one, and clients
made by tests/foundation/run_secret.py sign their calls with it)."""

import os
import secrets
from collections.abc import Iterator

import pytest

from podrl.cli.local_cluster import ChildExitedError

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "PODRL_RUN_SECRET_FILE" not in os.environ:
    os.environ.setdefault("PODRL_RUN_SECRET", secrets.token_hex(32))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A service that exited under a test (``ChildExitedError``, often in a fixture's setup)
    gets its log's last lines in the report: CI keeps only what pytest prints, and without them
    a crash at start-up on a loaded runner cannot be told from another."""
    outcome = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if isinstance(error, ChildExitedError):
        report = outcome.get_result()
        report.sections.append(
            (f"last lines of {error.child.log_path.name}", error.child.log_tail(80))
        )
