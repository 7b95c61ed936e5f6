"""The asyncio loop vLLM's engine runs on, in one background thread.

The gRPC server's threads hand the engine work with :meth:`EngineLoop.submit`, so concurrent
Generate calls batch inside the engine; in-flight weight applies and the engine's mirror of
the workers' weight state change on this thread, between two engine steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


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
