"""Where a weight sync's milliseconds go, part by part (bench only).

``bench/vllm_cuda.py`` runs this after its sync measurement: a few more syncs, each part of
the path timed by wrapping the function that does it (wall time per call, added up per
call), on both sides of the ``collective_rpc`` hop:

* in the generator service's process (``engine.*``): the manifest's MAC check, the workers'
  ``collective_rpc`` round trip, the prefix-cache reset, and ``WeightApplier.apply``
  as a whole;
* in vLLM's worker (``worker.*``): the receiver's validation, its finiteness check, the copy
  plan's launch and wait, the device synchronize, the whole ``podrl_apply_manifest``; the last
  apply also under ``torch.profiler`` (CPU and CUDA ops: which kernels, how many launches).

The timers wrap the real functions and call them unchanged: what is applied is podrl's code.
"""

from __future__ import annotations

import functools
import inspect
import statistics
import time
from collections import defaultdict
from typing import Any

import torch


class CallTimes:
    """Wall seconds of every call of the wrapped callables, by label."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)
        record = self.seconds[label]
        if inspect.iscoroutinefunction(original):

            @functools.wraps(original)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    record.append(time.perf_counter() - started)

            setattr(owner, attr, timed_async)
        else:

            @functools.wraps(original)
            def timed(*args: Any, **kwargs: Any) -> Any:
                started = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    record.append(time.perf_counter() - started)

            setattr(owner, attr, timed)
        self._undo.append((owner, attr, original))

    def undo(self) -> None:
        for owner, attr, original in reversed(self._undo):
            setattr(owner, attr, original)
        self._undo.clear()

    def medians_ms(self) -> dict[str, dict[str, float]]:
        """Per label: median ms per call, calls, and the summed ms."""
        return {
            label: {
                "median_ms": statistics.median(values) * 1e3,
                "calls": len(values),
                "total_ms": sum(values) * 1e3,
            }
            for label, values in sorted(self.seconds.items())
            if values
        }


# ---- in vLLM's worker process ---------------------------------------------------------------


def wrap_worker_side(times: CallTimes) -> None:
    """The receiver's parts (module functions and class methods, so every receiver is timed)."""
    from podrl.weights import receiver

    times.wrap(receiver.WeightReceiver, "validate", "worker.validate")
    times.wrap(receiver, "_require_finite", "worker.require_finite")
    times.wrap(receiver.WeightReceiver, "_compile", "worker.compile_plan")
    times.wrap(receiver.CopyPlan, "launch", "worker.plan_launch")
    times.wrap(receiver.CopyPlan, "wait", "worker.plan_wait")
    times.wrap(receiver.WeightReceiver, "apply", "worker.receiver_apply")
    if torch.cuda.is_available():
        times.wrap(torch.cuda, "synchronize", "worker.cuda_synchronize")


def profile_table(call: Any, rows: int = 25) -> tuple[Any, str]:
    """``call()`` under torch.profiler (CPU, and CUDA when there is one); its result and the
    ops table sorted by self CPU time."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        result = call()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return result, table


# ---- in the generator service's process -----------------------------------------------------


def wrap_engine_side(times: CallTimes, engine: Any) -> None:
    """The engine's parts around the workers' apply (``engine`` is a started ``VllmEngine``;
    the labels keep the names of the recorded results)."""
    times.wrap(engine.parts.applier, "apply", "engine.apply_manifest")
    times.wrap(engine._key, "verify", "engine.verify_mac")
    times.wrap(engine._engine, "collective_rpc", "engine.collective_rpc")
    times.wrap(engine._engine, "reset_prefix_cache", "engine.reset_prefix_cache")


def measure_apply_anatomy(pod: Any, reps: int = 5) -> dict[str, Any]:
    """``reps`` version-only syncs (a Train before each) with every part timed, then one more
    whose apply in the worker runs under torch.profiler (its times are not in the medians).
    ``pod`` is ``bench.vllm_cuda.Pod``."""
    times = CallTimes()
    wrap_engine_side(times, pod.engine)
    pod.rpc_worker("podrl_bench_anatomy", "start")
    syncs = []
    try:
        for _ in range(reps):
            pod.train(pod.random_batch())
            syncs.append(pod.sync())
    finally:
        times.undo()
        worker_parts = pod.rpc_worker("podrl_bench_anatomy", "stop")[0]
    pod.rpc_worker("podrl_bench_anatomy", "profile_next")
    pod.train(pod.random_batch())
    pod.sync()
    profile = pod.rpc_worker("podrl_bench_anatomy", "profile_result")[0]
    keys = ("publish_s", "apply_rpc_s", "apply_in_worker_s", "ack_s", "ready_to_ack_s")
    return {
        "reps": reps,
        "rpc_median_ms": {k: statistics.median(r[k] for r in syncs) * 1e3 for k in keys},
        "engine": times.medians_ms(),
        "worker": worker_parts,
        "worker_profile": profile,
    }
