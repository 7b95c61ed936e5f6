"""In-flight applies (podrl.generator.weight_applier) without an engine: which engines take them,
and how a failed one fails the Generate calls it interrupted (the real engine:
test_in_flight_apply.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from podrl.generator.weight_applier import (
    PAUSE_KEEP,
    UNSUPPORTED,
    GenerateSpan,
    InterruptedGenerateError,
    RunningGenerates,
    in_flight_apply_kind,
)


class PausingCore:
    async def pause_scheduler_async(self, mode: str = "abort", clear_cache: bool = True) -> None:
        pass

    async def resume_scheduler_async(self) -> None:
        pass


class ModelessCore:
    async def pause_scheduler_async(self) -> None:
        pass

    async def resume_scheduler_async(self) -> None:
        pass


class Engine:
    def __init__(self, core: Any) -> None:
        self.engine_core = core


@pytest.mark.parametrize(
    ("engine", "kind"),
    [
        (Engine(PausingCore()), PAUSE_KEEP),
        (Engine(ModelessCore()), UNSUPPORTED),  # a pause without modes would abort requests
        (Engine(object()), UNSUPPORTED),
        (object(), UNSUPPORTED),
    ],
)
def test_only_an_engine_that_can_pause_in_keep_mode_takes_in_flight_applies(
    engine: Any, kind: str
) -> None:
    assert in_flight_apply_kind(engine) == kind


def test_a_failed_apply_fails_the_running_generates_and_a_caller_cancel_stays_a_cancel() -> None:
    running = RunningGenerates()

    async def generate(started: asyncio.Event) -> str:
        with running.track(GenerateSpan(3, [3])):
            started.set()
            await asyncio.sleep(60)
        return "samples"

    async def scenario() -> tuple[BaseException | str, BaseException | str]:
        first, second = asyncio.Event(), asyncio.Event()
        failed = asyncio.create_task(generate(first))
        cancelled = asyncio.create_task(generate(second))
        await first.wait()
        await second.wait()
        cancelled.cancel()  # its caller's deadline passed
        await asyncio.sleep(0)
        assert running.fail_all("applying version 4 in flight failed part-way") == 1
        outcomes = await asyncio.gather(failed, cancelled, return_exceptions=True)
        assert running.fail_all("nothing runs now") == 0  # both calls left the tracker
        return outcomes[0], outcomes[1]

    failed, cancelled = asyncio.run(scenario())
    assert isinstance(failed, InterruptedGenerateError)
    assert "applying version 4 in flight failed part-way while this Generate ran" in str(failed)
    assert "needs a full manifest" in str(failed)
    assert isinstance(cancelled, asyncio.CancelledError)
