"""Rank 0 drives the other trainer ranks through a table of named collective commands.

Every rank registers the same handlers (``CommandLoop.register``) at start-up. Rank 0 (which
serves gRPC) calls ``loop.run(name, payload)``: the command goes to every rank as a serialized
``RankCommand`` protobuf in a uint8 tensor (length first), every rank - rank 0 included - runs
the handler, and the ``RankReply`` of each rank is gathered on rank 0. Ranks > 0 sit in
``loop.serve_forever()`` until rank 0 sends ``shutdown`` (or dies: the socket error ends them).

The messages travel over a dedicated gloo group (CPU tensors), whatever backend the model uses,
so an idle trainer does not hit the model group's collective timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from podrl.config.trainer import TrainerConfig
from podrl.trainer.errors import ErrorKind, error_kind
from podrl.v1 import trainer_pb2
from podrl.weights.distributed import gather_bytes

log = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
RankHandler = Callable[[bytes], bytes]
"""A command handler: the payload rank 0 sent → this rank's reply payload. It runs on every
rank, so it may (and usually does) run collectives over the model's process groups."""
Cancelled = Callable[[], bool]
"""True once the caller of a running command gave up on it (rank 0's gRPC caller)."""
CancellableHandler = Callable[[bytes, Cancelled], bytes]
"""A handler that also hears whether its caller cancelled: rank 0's caller's predicate on
rank 0, :func:`never_cancelled` on the other ranks (a handler that acts on it must agree
with the other ranks first, as every collective does)."""


def never_cancelled() -> bool:
    """The cancellation of a command nobody can cancel (ranks > 0, direct calls)."""
    return False


# Kinds that all mean "no rank stepped, nothing changed" (a NonFiniteStepError is one).
_ABORTED_KINDS = frozenset(
    {trainer_pb2.RANK_ERROR_KIND_STEP_ABORTED, trainer_pb2.RANK_ERROR_KIND_NON_FINITE_STEP}
)


class RankCommandError(RuntimeError):
    """A command failed on one or more ranks; the message names each rank and its error.
    ``errors`` holds the failed ranks' replies, by rank."""

    def __init__(self, name: str, errors: dict[int, trainer_pb2.RankReply]) -> None:
        self.errors = errors
        detail = "; ".join(f"rank {rank}: {r.error}" for rank, r in sorted(errors.items()))
        super().__init__(f"trainer command {name!r} failed: {detail}")

    @property
    def kind(self) -> ErrorKind:
        """The failure's kind when every failed rank reports the same one; ranks that all
        aborted the step (some of them for a non-finite one) aborted it; any other mix is
        INTERNAL."""
        kinds = {reply.error_kind for reply in self.errors.values()}
        if len(kinds) == 1:
            return kinds.pop()
        if kinds <= _ABORTED_KINDS:
            return trainer_pb2.RANK_ERROR_KIND_STEP_ABORTED
        return trainer_pb2.RANK_ERROR_KIND_INTERNAL

    @property
    def first_message(self) -> str:
        """The lowest failed rank's own error message (without its type)."""
        return self.errors[min(self.errors)].error_message


class CommandLoop:
    """The dispatch table plus the wire between rank 0 and the others. ``idle_timeout``: how
    long ranks > 0 wait for the next command (``trainer.command_idle_timeout_seconds``)."""

    def __init__(self, idle_timeout: timedelta) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Its own gloo group: commands are CPU bytes, and ranks > 0 may wait long between them.
        self._group = dist.new_group(backend="gloo", timeout=idle_timeout)
        self._handlers: dict[str, CancellableHandler] = {}
        self._lock = threading.Lock()
        self._closed = False

    def register(self, name: str, handler: RankHandler) -> None:
        """Add a command; call it on EVERY rank, in the same order, before serving."""
        self.register_cancellable(name, lambda payload, _cancelled: handler(payload))

    def register_cancellable(self, name: str, handler: CancellableHandler) -> None:
        """Add a command whose handler also gets the caller's cancellation (as ``register``)."""
        if name == SHUTDOWN or name in self._handlers:
            raise ValueError(f"rank command {name!r} is already registered")
        self._handlers[name] = handler

    @classmethod
    def build(cls, settings: TrainerConfig) -> CommandLoop:
        """This rank's loop, from the trainer's config section."""
        return cls(timedelta(seconds=settings.command_idle_timeout_seconds))

    @property
    def commands(self) -> list[str]:
        return sorted(self._handlers)

    # -- wire ----------------------------------------------------------------------------------

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(length, src=0, group=self._group)
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(length.item()), dtype=torch.uint8)
        if buffer.numel():
            dist.broadcast(buffer, src=0, group=self._group)
        return bytes(buffer.numpy().tobytes()) if self.rank else data

    def _dispatch(
        self, command: trainer_pb2.RankCommand, cancelled: Cancelled = never_cancelled
    ) -> trainer_pb2.RankReply:
        handler = self._handlers.get(command.name)
        if handler is None:
            return trainer_pb2.RankReply(error=f"unknown rank command {command.name!r}")
        try:
            return trainer_pb2.RankReply(payload=handler(command.payload, cancelled))
        except Exception as err:  # reported to rank 0, which raises RankCommandError
            log.exception("rank command %r failed on rank %d", command.name, self.rank)
            return trainer_pb2.RankReply(
                error=f"{type(err).__name__}: {err}",
                error_kind=error_kind(err),
                error_message=str(err),
            )

    # -- rank 0 --------------------------------------------------------------------------------

    def run(
        self, name: str, payload: bytes = b"", *, cancelled: Cancelled = never_cancelled
    ) -> list[bytes]:
        """Rank 0: run ``name`` on every rank; the reply payloads, indexed by rank.
        ``cancelled`` reaches rank 0's handler of a cancellable command.

        Commands are serialised (one at a time). Raises RankCommandError if any rank failed.
        """
        if self.rank != 0:
            raise RuntimeError("only rank 0 issues rank commands")
        if name not in self._handlers:
            raise KeyError(f"unknown rank command {name!r}; registered: {self.commands}")
        with self._lock:
            if self._closed:
                raise RuntimeError("the trainer's rank command loop is shut down")
            command = trainer_pb2.RankCommand(name=name, payload=payload)
            if self.world_size == 1:  # no other rank to tell: four collectives saved a command
                replies = [self._dispatch(command, cancelled)]
            else:
                self._broadcast_bytes(command.SerializeToString())
                reply = self._dispatch(command, cancelled)
                replies = [trainer_pb2.RankReply.FromString(b) for b in self._gather(reply)]
        errors = {rank: r for rank, r in enumerate(replies) if r.error}
        if errors:
            raise RankCommandError(name, errors)
        return [r.payload for r in replies]

    def _gather(self, reply: trainer_pb2.RankReply) -> list[bytes]:
        return gather_bytes(reply.SerializeToString(), dst=0, group=self._group)

    def shutdown(self) -> None:
        """Rank 0: tell the other ranks to leave ``serve_forever`` (idempotent)."""
        with self._lock:
            if self._closed or self.rank != 0:
                return
            self._closed = True
            if self.world_size > 1:
                command = trainer_pb2.RankCommand(name=SHUTDOWN)
                self._broadcast_bytes(command.SerializeToString())

    # -- ranks > 0 -----------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Ranks > 0: run commands from rank 0 until ``shutdown``."""
        if self.rank == 0:
            raise RuntimeError("rank 0 issues commands; it does not serve them")
        while True:
            command = trainer_pb2.RankCommand.FromString(self._broadcast_bytes(None))
            if command.name == SHUTDOWN:
                log.info("rank %d: shutdown from rank 0", self.rank)
                return
            self._gather(self._dispatch(command))
