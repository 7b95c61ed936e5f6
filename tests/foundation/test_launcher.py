"""`podrl up` as a user runs it: starts the services (and the Lighthouse that lets more pods
join), stops all of them, starts a dead pod service again, and ends when the controller dies."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

READY_LINE = "podrl is up"


def _start_up(tmp_path: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PODRL_RUN_DIR": str(tmp_path / "run"), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "podrl.cli", "up", "--startup-timeout", "300"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_until_up(proc: subprocess.Popen[str]) -> list[str]:
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if READY_LINE in line:
            return lines
    raise AssertionError("podrl up exited before it was up:\n" + "".join(lines))


def _children(proc: subprocess.Popen[str]) -> dict[str, psutil.Process]:
    by_service = {}
    for child in psutil.Process(proc.pid).children():
        cmdline = child.cmdline()
        service = cmdline[cmdline.index("-m") + 1].removeprefix("podrl.")
        by_service[service] = child
    return by_service


def _assert_all_gone(processes: list[psutil.Process], timeout: float = 30) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    assert not alive, f"still running: {[p.pid for p in alive]}"


SERVICES = {"controller", "generator", "grader", "trainer"}


def _read_until(proc: subprocess.Popen[str], text: str) -> list[str]:
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"podrl up ended before printing {text!r}:\n" + "".join(lines))


def test_a_dead_pod_service_is_started_again_and_sigterm_stops_every_child(
    tmp_path: Path,
) -> None:
    proc = _start_up(tmp_path)
    try:
        started = _wait_until_up(proc)
        # How long each service took to become ready, on one line however narrow the output.
        (ready,) = [line for line in started if line.startswith("podrl: ready after: ")]
        assert re.fullmatch(
            r"podrl: ready after: controller [\d.]+ s(, \w+ [\d.]+ s){3}\n", ready
        ), ready
        children = _children(proc)
        # The default run may grow to more pods, so the Lighthouse runs beside the controller.
        assert set(children) == SERVICES | {"trainer.lighthouse"}
        # What kubelet does for a container of the pod: the run goes on with a new grader.
        children["grader"].kill()
        lines = _read_until(proc, "starting it again")
        assert "grader was killed by SIGKILL" in lines[-1]
        assert "(restart 1/" in lines[-1]
        grader_log = tmp_path / "run" / "logs" / "grader.log"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            grader = _children(proc).get("grader")
            serving = grader_log.read_text().count("grader serving gRPC on")
            if grader is not None and grader.pid != children["grader"].pid and serving == 2:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("no new grader serving after the restart line")
        assert proc.poll() is None, "the launcher ended after a pod service died"
        children = _children(proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        _assert_all_gone(list(children.values()))
        # Each service went through its graceful path (NOT_SERVING, drain, stop), none was killed.
        for name in SERVICES:
            log = (tmp_path / "run" / "logs" / f"{name}.log").read_text()
            assert f"{name} shutting down (SIGTERM)" in log, name
            assert f"{name} stopped" in log, name
        lighthouse_log = (tmp_path / "run" / "logs" / "lighthouse.log").read_text()
        assert "lighthouse: SIGTERM, stopping" in lighthouse_log
        # Both of its servers on loopback: the front, which checks the trainers' replica ids
        # with the run's secret, and torchft's own (its status page, its kill endpoint).
        listening = re.search(
            r"lighthouse listening on 127\.0\.0\.1:\d+ \(the torchft Lighthouse on "
            r"127\.0\.0\.1:\d+, loopback only; replica ids must carry the run secret's MAC",
            lighthouse_log,
        )
        assert listening, lighthouse_log
    finally:
        proc.kill()


def test_a_dead_controller_is_reported_and_up_exits_nonzero(tmp_path: Path) -> None:
    proc = _start_up(tmp_path)
    try:
        _wait_until_up(proc)
        children = _children(proc)
        children["controller"].kill()
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 1
        assert "controller" in output and "SIGKILL" in output
        _assert_all_gone(list(children.values()))
    finally:
        proc.kill()


def test_children_do_not_outlive_a_killed_launcher(tmp_path: Path) -> None:
    proc = _start_up(tmp_path)
    try:
        _wait_until_up(proc)
        children = list(_children(proc).values())
        proc.kill()  # SIGKILL: the launcher cannot clean up; the kernel's parent-death signal does
        proc.wait(timeout=10)
        _assert_all_gone(children)
    finally:
        proc.kill()


def test_self_check_passes(tmp_path: Path) -> None:
    env = {**os.environ, "PODRL_RUN_DIR": str(tmp_path / "run")}
    result = subprocess.run(
        [sys.executable, "-m", "podrl.cli", "up", "--self-check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout
