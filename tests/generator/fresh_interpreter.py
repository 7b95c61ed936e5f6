"""Runs a snippet in a fresh interpreter with one environment variable set or unset: the vLLM
plugin's patches change vLLM's modules for the whole process, so each case needs its own."""

from __future__ import annotations

import os
import subprocess
import sys


def run_with(variable: str, value: str | None, code: str) -> str:
    """``code``'s standard output, with ``variable`` set to ``value`` (unset for None)."""
    env = {k: v for k, v in os.environ.items() if k != variable}
    if value is not None:
        env[variable] = value
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
