"""Debian's headless Chromium, for tests that render the dashboard as a browser would."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)"
)


def chromium(*args: str, user_dir: Path) -> subprocess.CompletedProcess[str]:
    """Run headless Chromium with ``args`` (e.g. ``--dump-dom URL``) and a profile of its own,
    with no network but the page's."""
    assert CHROMIUM is not None
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={user_dir}",
        "--virtual-time-budget=5000",
    ]
    return subprocess.run(
        [CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120, check=True
    )
