"""Weight applies that land while Generate calls run (``ApplyWeightsRequest.in_flight``).

Without ``in_flight`` an apply waits for every running Generate (the engine's write lock), so
each sample is produced by one policy version. With it, the apply lands between two engine
steps while requests run, as NeMo-RL's in-flight weight updates and SkyRL's keep-mode pause do:

- how it lands depends on where vLLM's engine core runs (:func:`in_flight_apply_kind`): in this
  process (:class:`~podrl.generator.engine_runtime.InlineEngine`) the apply runs on the engine's
  loop thread right after the step in progress; with ``AsyncLLM`` the scheduler is paused in
  vLLM's "keep" mode (requests stay where they are), the workers apply, and it resumes;
- after a version changed, vLLM's prefix cache is reset with its running requests preempted,
  so their KV blocks are recomputed by the new weights: every token sampled after the apply
  comes from the new weights alone;
- each Generate reads the served version when it starts and when each prompt's request
  finished (:class:`GenerateSpan`): a sample's ``policy_version`` .. ``last_policy_version``
  covers every version that sampled a token of it;
- an apply that leaves the weights of no known version (needs_full) fails the Generate calls
  it interrupted (:class:`InterruptedGenerateError`): their later tokens came from unknown
  weights. A refused manifest, or one that failed before vLLM's parameters were touched,
  interrupts nothing.

Everything here runs on the engine's event-loop thread (one thread: no locks needed).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from podrl.generator import vllm_compat
from podrl.generator.weight_state import NEEDS_FULL_HINT, WeightsNotServableError

BETWEEN_STEPS = "between_steps"
PAUSE_KEEP = "pause_keep"
UNSUPPORTED = "unsupported"


class InterruptedGenerateError(WeightsNotServableError):
    """An in-flight apply left the weights of no known version while this Generate ran: its
    samples are not returned (→ FAILED_PRECONDITION, "needs a full manifest")."""


def in_flight_apply_kind(engine: Any) -> str:
    """How an in-flight apply lands on ``engine``: :data:`BETWEEN_STEPS` for podrl's in-process
    engine, :data:`PAUSE_KEEP` for an ``AsyncLLM`` whose engine-core client pauses and resumes
    the scheduler (``pause_scheduler_async``, ``resume_scheduler_async``) with vLLM's "keep"
    mode, :data:`UNSUPPORTED` otherwise (applies then wait for running Generates)."""
    from podrl.generator.engine_runtime import InlineEngine

    if isinstance(engine, InlineEngine):
        return BETWEEN_STEPS
    return PAUSE_KEEP if vllm_compat.pauses_in_keep_mode(engine) else UNSUPPORTED


@dataclass
class GenerateSpan:
    """One Generate call as the engine's loop thread saw it."""

    first_version: int
    """The version served when its requests were added."""
    last_versions: list[int] = field(default_factory=list)
    """Per prompt: the version served when that prompt's request finished."""
    lost: str | None = None
    """Why an in-flight apply failed it (None: it was not)."""


class RunningGenerates:
    """The Generate calls running on the engine's loop thread, so that an in-flight apply that
    failed part-way can fail them."""

    def __init__(self) -> None:
        self._running: dict[asyncio.Task[Any], GenerateSpan] = {}

    @contextmanager
    def track(self, span: GenerateSpan) -> Iterator[GenerateSpan]:
        """Count the current task as running ``span`` for the block. A cancellation caused by
        :meth:`fail_all` leaves it as :class:`InterruptedGenerateError`."""
        task = asyncio.current_task()
        assert task is not None, "track() runs inside a task on the engine's loop"
        self._running[task] = span
        try:
            yield span
        except asyncio.CancelledError:
            if span.lost is None:
                raise  # the caller cancelled (its deadline passed, the client went away)
            raise InterruptedGenerateError(span.lost) from None
        finally:
            self._running.pop(task, None)

    def fail_all(self, why: str) -> int:
        """Fail every running Generate (its requests are aborted); how many there were."""
        for task, span in self._running.items():
            span.lost = (
                f"{why} while this Generate ran: its samples' later tokens came from weights of "
                f"no known version; {NEEDS_FULL_HINT}"
            )
            task.cancel()
        return len(self._running)
