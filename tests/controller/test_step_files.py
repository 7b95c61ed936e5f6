"""The controller files one synchronous step and one weight sync run, recorded from a real run
against a fake pod and the real grader: the counts docs/architecture.md's "How many files a step
and a sync touch" gives for the controller (every file that holds a function run on the path)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import podrl.controller
from podrl.controller.step.loop import StepParts, SyncSteps
from tests.controller.fake_pod_loop import RunLoop
from tests.controller.fake_workers import FakePod
from tests.harness.file_hook import file_hook

CONTROLLER = Path(podrl.controller.__file__).resolve().parent

#: The step's controller files: the driver, the calls to the pods, the batch, the pod table,
#: the recorder and the status the recorder updates.
STEP_FILES = {
    "step/loop.py",
    "step/pod_calls.py",
    "step/batch.py",
    "pods/table.py",
    "records/recorder.py",
    "service/status.py",
}
#: The sync's: the driver and the calls (the pod table and the status are not written).
SYNC_FILES = {"step/loop.py", "step/pod_calls.py"}


class Recorder:
    """Adds the controller file of every Python function called, in the calling thread and in
    the calls the loop's pool runs meanwhile, to each set that is recording."""

    def __init__(self) -> None:
        self.active: list[set[str]] = []

    @contextmanager
    def recording(self, files: set[str], parts: StepParts) -> Iterator[None]:
        self.active.append(files)
        before = sys.getprofile()
        submit = parts.pool.submit
        sets = list(self.active)

        def traced(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            def run() -> Any:
                sys.setprofile(file_hook(CONTROLLER, *sets))
                try:
                    return fn(*args, **kwargs)
                finally:
                    sys.setprofile(None)

            return submit(run)

        parts.pool.submit = traced  # type: ignore[method-assign]
        sys.setprofile(file_hook(CONTROLLER, *sets))
        try:
            yield
        finally:
            sys.setprofile(before)
            self.active.remove(files)
            if self.active:
                parts.pool.submit = submit  # type: ignore[method-assign]
            else:
                del parts.pool.submit


def test_a_step_runs_six_controller_files_and_its_weight_sync_two(
    pod: FakePod, run_loop: RunLoop, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder()
    steps: list[set[str]] = []
    syncs: list[set[str]] = []
    run_step, sync_weights = SyncSteps.run_step, StepParts.sync_weights

    def recorded_step(self: SyncSteps, attempt: int) -> Any:
        steps.append(set())
        with recorder.recording(steps[-1], self.parts):
            return run_step(self, attempt)

    def recorded_sync(self: StepParts, *args: Any, **kwargs: Any) -> Any:
        syncs.append(set())
        with recorder.recording(syncs[-1], self):
            return sync_weights(self, *args, **kwargs)

    monkeypatch.setattr(SyncSteps, "run_step", recorded_step)
    monkeypatch.setattr(StepParts, "sync_weights", recorded_sync)
    run = run_loop(pod, steps=2, checkpoint_every=0)
    assert run["state"].view().phase == "finished"
    assert len(steps) == len(syncs) == 2
    for files in steps:
        assert files <= STEP_FILES, sorted(files - STEP_FILES)
    for files in syncs:
        assert "step/pod_calls.py" in files and files <= SYNC_FILES, sorted(files - SYNC_FILES)
