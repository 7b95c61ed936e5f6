"""The fault-injection points chaos tests use (podrl.common.faults)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from podrl.common import faults


@pytest.fixture(autouse=True)
def _clear_plan():
    yield
    faults.reset("[]")


def test_rule_matches_context_and_fires_the_given_number_of_times():
    faults.reset('[{"point": "p", "rank": 1, "times": 2, "skip": 1}]')
    faults.hit("p", rank=0)  # other rank: never fires
    faults.hit("p", rank=1)  # skipped
    for _ in range(2):
        with pytest.raises(faults.InjectedFaultError, match="injected fault at p"):
            faults.hit("p", rank=1)
    faults.hit("p", rank=1)  # times exhausted
    faults.hit("q", rank=1)  # other point


def test_delay_rule_stalls_the_caller():
    faults.reset('[{"point": "slow", "action": "delay", "seconds": 0.2}]')
    started = time.monotonic()
    faults.hit("slow")
    assert time.monotonic() - started >= 0.2


def test_a_rule_with_a_while_file_triggers_only_while_the_file_exists(tmp_path):
    gate = tmp_path / "gate"
    faults.reset(f'[{{"point": "p", "times": 2, "while_file": "{gate}"}}]')
    faults.hit("p")  # no file: not counted either
    gate.touch()
    with pytest.raises(faults.InjectedFaultError):
        faults.hit("p")
    gate.unlink()
    faults.hit("p")
    gate.touch()
    with pytest.raises(faults.InjectedFaultError):  # the second of its two times
        faults.hit("p")
    faults.hit("p")  # times exhausted


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ("{", "not valid JSON"),
        ('{"point": "p"}', "JSON list"),
        ('[{"action": "raise"}]', r"\[0\] needs a string 'point'"),
        ('[{"point": "p", "action": "explode"}]', r"\[0\]\.action must be one of"),
    ],
)
def test_malformed_plan_names_the_rule(plan, message):
    with pytest.raises(ValueError, match=message):
        faults.parse(plan)


def test_fault_points_are_armed_only_in_a_process_with_a_plan(monkeypatch):
    """A fault point is ``if faults.ARMED: faults.hit(...)``: without a plan it runs nothing of
    the module, and the flag follows the plan, read at import and by reset()."""
    code = "from podrl.common import faults; print(faults.ARMED)"
    env = {k: v for k, v in os.environ.items() if k != faults.ENV_VAR}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "services")
    runs = [
        subprocess.run([sys.executable, "-c", code], env=extra, capture_output=True, text=True)
        for extra in (env, {**env, faults.ENV_VAR: '[{"point": "p"}]'})
    ]
    assert [run.stdout.strip() for run in runs] == ["False", "True"], [r.stderr for r in runs]

    monkeypatch.delenv(faults.ENV_VAR, raising=False)
    faults.reset()
    assert not faults.ARMED
    faults.reset('[{"point": "p"}]')
    assert faults.ARMED
    faults.reset("[]")
    assert not faults.ARMED
    monkeypatch.setenv(faults.ENV_VAR, '[{"point": "p"}]')
    faults.reset()
    assert faults.ARMED
