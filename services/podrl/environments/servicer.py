"""gRPC Environment service: episodes as sessions keyed by episode id, each Reset and Step run in
the isolated worker pool (``podrl.environments.isolation``); the status codes are listed in
proto/podrl/v1/environment.proto.

A session holds its environment as pickled bytes, its turn count and whether it ended. A step
whose environment code fails (raises, hangs past ``environments.step_timeout_seconds``, runs
out of ``environments.worker_memory_mib``, kills its worker) removes its session and fails that
call only; every other episode goes on, and pebble replaces the worker. A step its caller
cancels leaves the session as it was before it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc
from prometheus_client import Counter, Gauge, Histogram

import podrl
from podrl.config import RunConfig
from podrl.environments.isolation import (
    EnvironmentSpec,
    Limits,
    StateSizeError,
    StepOutput,
    reset_episode,
    step_episode,
)
from podrl.grader.servicer import JobFailure, WorkerPool
from podrl.v1 import common_pb2, environment_pb2, environment_pb2_grpc

log = logging.getLogger(__name__)

STEPS = Counter(
    "podrl_environment_steps_total", "Resets and Steps run, failed ones included", ["environment"]
)
ERRORS = Counter(
    "podrl_environment_errors_total",
    "Episodes failed by their environment (exception, timeout, memory, worker_died)",
    ["environment", "error"],
)
TOOL_CALLS = Counter("podrl_environment_tool_calls_total", "Tool calls run", ["environment"])
TOOL_ERRORS = Counter(
    "podrl_environment_tool_errors_total", "Tool calls that failed", ["environment"]
)
STEP_SECONDS = Histogram(
    "podrl_environment_step_seconds", "Reset and Step time in the worker pool", ["environment"]
)
SESSIONS = Gauge("podrl_environment_sessions", "Open sessions")

_MESSAGE_CHARS = 1000


@dataclass
class Session:
    environment: str
    state: bytes = b""
    turn: int = 0
    done: bool = False
    truncated: bool = False
    busy: bool = True
    """A Reset or Step of this episode runs now (a session starts busy: its Reset)."""
    last_used: float = field(default_factory=time.monotonic)


class EnvironmentServicer(environment_pb2_grpc.EnvironmentServicer):
    def __init__(
        self, config: RunConfig, specs: dict[str, EnvironmentSpec], pool: WorkerPool
    ) -> None:
        self._config = config
        self._section = config.environments
        self._specs = specs
        self._pool = pool
        self._limits = Limits(self._section.max_tool_output_chars, self._section.max_state_bytes)
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> environment_pb2.EnvironmentInfo:
        section = self._section
        with self._lock:
            sessions = len(self._sessions)
        return environment_pb2.EnvironmentInfo(
            info=common_pb2.ServiceInfo(
                service="podrl.v1.Environment",
                version=podrl.__version__,
                worker_id=self._config.worker_id,
            ),
            environments=list(self._specs),
            sources=[spec.source for spec in self._specs.values()],
            sessions=sessions,
            max_sessions=section.max_sessions,
            max_turns=section.max_turns,
            max_episode_tokens=section.max_episode_tokens,
            step_timeout_seconds=section.step_timeout_seconds,
            max_tool_output_chars=section.max_tool_output_chars,
            workers=self._pool.workers,
        )

    def Reset(
        self, request: environment_pb2.ResetRequest, context: grpc.ServicerContext
    ) -> environment_pb2.ResetResponse:
        _need_episode_id(request.episode_id, context)
        spec = self._specs.get(request.environment)
        if spec is None:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"environment {request.environment!r} is unknown; this service runs "
                f"{sorted(self._specs)} (environments.plugins adds more)",
            )
        episode = request.episode_id
        with self._lock:
            self._drop_idle()
            if episode in self._sessions:
                context.abort(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"episode {episode!r} is open; Close it first or use a new episode id",
                )
            if len(self._sessions) >= self._section.max_sessions:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{len(self._sessions)} episodes are open, environments.max_sessions "
                    f"({self._section.max_sessions}); Close finished episodes or raise it",
                )
            session = self._sessions[episode] = Session(spec.name)
            SESSIONS.set(len(self._sessions))
        args = (
            spec,
            request.prompt,
            request.reference,
            dict(request.metadata),
            request.seed,
            self._limits,
        )
        output = self._run(episode, session, reset_episode, args, context)
        with self._lock:
            session.state, session.busy = output.state, False
        return environment_pb2.ResetResponse(
            observation=output.observation, observation_truncated=output.observation_truncated
        )

    def Step(
        self, request: environment_pb2.StepRequest, context: grpc.ServicerContext
    ) -> environment_pb2.StepResponse:
        _need_episode_id(request.episode_id, context)
        episode = request.episode_id
        with self._lock:
            session = self._sessions.get(episode)
            if session is None:
                context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"no open episode {episode!r} (never reset, closed, failed, or dropped "
                    f"after environments.session_idle_seconds without a call)",
                )
            if session.done:
                why = " at environments.max_turns" if session.truncated else ""
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"episode {episode!r} ended{why} after {session.turn} turns; Close it",
                )
            if session.busy:
                context.abort(
                    grpc.StatusCode.ABORTED,
                    f"a Reset or Step of episode {episode!r} is running; send one at a time",
                )
            session.busy, session.last_used = True, time.monotonic()
            state = session.state
        started = time.perf_counter()
        output = self._run(
            episode, session, step_episode, (state, request.action, self._limits), context
        )
        with self._lock:
            session.state, session.busy = output.state, False
            session.turn += 1
            session.done = output.done
            if not session.done and session.turn >= self._section.max_turns:
                session.done = session.truncated = True
            TOOL_CALLS.labels(session.environment).inc(output.tool_calls)
            TOOL_ERRORS.labels(session.environment).inc(output.tool_errors)
            return environment_pb2.StepResponse(
                observation=output.observation,
                observation_truncated=output.observation_truncated,
                reward=output.reward,
                done=session.done,
                truncated=session.truncated,
                turn=session.turn,
                tool_calls=output.tool_calls,
                tool_errors=output.tool_errors,
                latency_seconds=time.perf_counter() - started,
            )

    def Close(
        self, request: environment_pb2.CloseRequest, context: grpc.ServicerContext
    ) -> environment_pb2.CloseResponse:
        _need_episode_id(request.episode_id, context)
        with self._lock:
            closed = self._sessions.pop(request.episode_id, None) is not None
            SESSIONS.set(len(self._sessions))
        return environment_pb2.CloseResponse(closed=closed)

    def _run(
        self,
        episode: str,
        session: Session,
        function: Callable[..., StepOutput],
        args: tuple[Any, ...],
        context: grpc.ServicerContext,
    ) -> StepOutput:
        """``function(*args)`` in the pool for ``session``; on its failure the session is
        removed (a cancelled call only frees it) and the call aborts with its status."""
        caller_gone = threading.Event()
        context.add_callback(caller_gone.set)
        started = time.perf_counter()
        future = self._pool.submit(function, args, self._section.step_timeout_seconds)
        outcome = self._pool.wait(future, cancelled=caller_gone)
        STEPS.labels(session.environment).inc()
        STEP_SECONDS.labels(session.environment).observe(time.perf_counter() - started)
        if outcome.failure is None:
            return outcome.value
        if outcome.failure is JobFailure.CANCELLED:
            with self._lock:
                session.busy = False
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        with self._lock:
            if self._sessions.get(episode) is session:
                del self._sessions[episode]
            SESSIONS.set(len(self._sessions))
        self._fail(episode, session.environment, outcome.failure, outcome.error, context)

    def _fail(
        self,
        episode: str,
        environment: str,
        failure: JobFailure,
        error: BaseException | None,
        context: grpc.ServicerContext,
    ) -> NoReturn:
        section = self._section
        ended = f"episode {episode!r} ({environment}) ended"
        if failure is JobFailure.TIMEOUT:
            label, code = "timeout", grpc.StatusCode.DEADLINE_EXCEEDED
            message = (
                f"{ended}: its step ran past environments.step_timeout_seconds "
                f"({section.step_timeout_seconds:g}s); the worker was killed and replaced"
            )
        elif failure is JobFailure.WORKER_DIED:
            label, code = "worker_died", grpc.StatusCode.INTERNAL
            message = (
                f"{ended}: the worker process running its step died (exit code "
                f"{getattr(error, 'exitcode', None)}); it was replaced"
            )
        elif isinstance(error, MemoryError):
            label, code = "memory", grpc.StatusCode.RESOURCE_EXHAUSTED
            message = (
                f"{ended}: its step ran out of environments.worker_memory_mib "
                f"({section.worker_memory_mib} MiB of address space per worker)"
            )
        elif isinstance(error, StateSizeError):
            label, code = "state_size", grpc.StatusCode.RESOURCE_EXHAUSTED
            message = f"{ended}: {error}"
        else:
            label, code = "exception", grpc.StatusCode.INTERNAL
            message = f"{ended}: the environment raised {type(error).__name__}: {error}"
        ERRORS.labels(environment, label).inc()
        log.warning("%s", message)
        context.abort(code, message[:_MESSAGE_CHARS])

    def _drop_idle(self) -> None:
        """Drop sessions idle past ``environments.session_idle_seconds`` (caller holds the
        lock); a session whose step runs is never idle."""
        horizon = time.monotonic() - self._section.session_idle_seconds
        for episode, session in list(self._sessions.items()):
            if not session.busy and session.last_used < horizon:
                log.info("dropping idle episode %r", episode)
                del self._sessions[episode]


def _need_episode_id(episode_id: str, context: grpc.ServicerContext) -> None:
    if not episode_id:
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "episode_id is empty; every episode needs an id (its session's key)",
        )
