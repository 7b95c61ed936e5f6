"""The Trainer service: each RPC on rank 0 (gRPC: validation, idempotency, status codes) and as
the command every rank runs for it (the rank command loop, the command table, weight publishing).
One job: how an RPC reaches every rank. Each RPC that needs every rank is one named command, run
by every rank with the same payload.

**The loop.** Every rank registers the same handlers (:func:`register_commands`) at start-up.
Rank 0 (which serves gRPC) calls ``loop.run(name, payload)``: the command goes to every rank as
a serialized ``RankCommand`` protobuf in a uint8 tensor (length first), every rank - rank 0
included - runs the handler, and the ``RankReply`` of each rank is gathered on rank 0. Ranks > 0
sit in ``loop.serve_forever()`` until rank 0 sends ``shutdown`` (or dies: the socket error ends
them). The messages travel over a dedicated gloo group (CPU tensors), whatever backend the model
uses, so an idle trainer does not hit the model group's collective timeout.

**The commands.** Handlers take a serialized request message and return their rank's serialized
response; rank 0's reply is the one the servicer answers with. Train, checkpoints, export and
the parameters' digest call the engine; PublishWeights and AcknowledgeWeights call this rank's
:class:`WeightPublishing`, which reads the engine's model and train state but runs none of the
engine's code. To add a command, register it in :func:`register_commands`.

**Weight publishing.** ``publish`` runs on every rank: each rank starts the version on its own
shards (:class:`~podrl.weights.Publisher` ``start``, over ``engine.model``), the ranks' protobuf
bytes are gathered to rank 0 over the model's process group (no pickle) and rank 0 assembles the
manifest (``update``), which is its reply (``PublishWeightsResponse``). ``acknowledge`` finishes
the published version on every rank (``finish``); an acknowledgement of another version (never
published, or not the pending one) is FAILED_PRECONDITION and releases nothing.

On GPUs the FSDP2 parameters are published in place, so a Train is refused up front
(FAILED_PRECONDITION) while a published version is unacknowledged, and an optimizer pre-step
hook guards the parameters as a last line (``trainer.weights_ack_timeout_seconds``, then the step
fails rather than overwrite weights a generator may be reading). On CPUs the staging
copy makes the step safe; only the next publish waits for the acknowledgement.

The trainer's servicer checks the gate under the lock that PublishWeights and
AcknowledgeWeights also take, so no publication lands between the check and the step and the
hook never waits in the service; it does when ``TrainerEngine.train_step`` is driven directly
(tests/gpu). The hook runs inside ``optimizer.step``, after the ranks agreed to step, so a wait
that times out there is outside Train's all-or-nothing rule: the gate is what keeps it away.

Before publishing, every rank checks its own shards for NaN and infinity and the ranks agree
(one all-reduce): if any rank holds such a value, every rank refuses alike (``PublishError`` →
FAILED_PRECONDITION naming the rank and parameter) and nothing becomes pending. Rank 0 signs
the manifest with the pod's weights key (``podrl.weights.protocol``, ``PODRL_WEIGHTS_KEY_FILE``;
created by the trainer's first start in the pod when the file does not exist yet).

**The gRPC service** (rank 0). Each RPC that changes or reads sharded state runs on every rank
through the rank command loop; validation happens here first, so a bad request never reaches the
other ranks. PublishWeights/AcknowledgeWeights run :class:`WeightPublishing` on every rank,
never the engine.

Train (docs/trainer.md):

* all or nothing over every rank (``TrainerEngine.train_step``): a rank failing before the
  optimizer step → ABORTED, nothing changed anywhere, the batch may be sent again; a loss or
  gradient norm that is NaN or infinite → FAILED_PRECONDITION, nothing changed (the same batch
  would fail again); any other failure → INTERNAL;
* idempotent by ``TrainRequest.batch_id``: the batch applied last is answered with its stored
  reply and trains nothing; a retry sent while the first call runs waits for it (the lock);
* every RPC that runs a command holds one lock, so PublishWeights/AcknowledgeWeights never land
  between a Train's gate check and its step;
* across pods (``trainer.replication``), the batch is checked inside the step, once this pod
  has joined the step's quorum and healed if it was behind: every rank refusing it alike →
  INVALID_ARGUMENT; a peer pod failing or leaving → ABORTED (nothing stepped on this pod).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import grpc
import torch
import torch.distributed as dist
from google.protobuf.message import Message
from torch.distributed.fsdp import FSDPModule

import podrl
from podrl.config import RunConfig
from podrl.config.trainer import TrainerConfig
from podrl.trainer import checkpoint, export, paths
from podrl.trainer.batch import BatchError, check_share_counts
from podrl.trainer.engine import Cancelled, TrainerEngine, never_cancelled
from podrl.trainer.errors import ErrorKind, TrainNotAllowedError, error_kind
from podrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from podrl.weights.distributed import gather_bytes, gather_publications
from podrl.weights.errors import PublishError
from podrl.weights.protocol import Publisher, load_trainer_key
from podrl.weights.publisher import ManifestAssembler, WeightPublisher, non_finite_message

log = logging.getLogger(__name__)


SHUTDOWN = "shutdown"
TRAIN = "train"
SAVE_CHECKPOINT = "save_checkpoint"
LOAD_CHECKPOINT = "load_checkpoint"
EXPORT_HF = "export_hf"
PARAMETERS_DIGEST = "parameters_digest"
PUBLISH_WEIGHTS = "publish_weights"
ACKNOWLEDGE_WEIGHTS = "acknowledge_weights"

RankHandler = Callable[[bytes], bytes]
"""A command handler: the payload rank 0 sent → this rank's reply payload. It runs on every
rank, so it may (and usually does) run collectives over the model's process groups."""
CancellableHandler = Callable[[bytes, Cancelled], bytes]
"""A handler that also hears whether its caller cancelled: rank 0's caller's predicate on
rank 0, :func:`never_cancelled` on the other ranks (a handler that acts on it must agree
with the other ranks first, as every collective does)."""


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


# -- the commands ---------------------------------------------------------------------------


def register_builtin_commands(loop: CommandLoop, engine: TrainerEngine) -> None:
    # The responses' ``step`` fields carry the policy version: the trainer counts one number.
    def train(payload: bytes, cancelled: Cancelled) -> bytes:
        request = trainer_pb2.TrainRequest.FromString(payload)
        return engine.train_step(request, cancelled).SerializeToString()

    def save(payload: bytes) -> bytes:
        request = trainer_pb2.SaveCheckpointRequest.FromString(payload)
        engine.save_checkpoint(Path(request.path), request.controller_state)
        version = engine.policy_version
        return trainer_pb2.SaveCheckpointResponse(
            path=request.path, step=version, policy_version=version
        ).SerializeToString()

    def load(payload: bytes) -> bytes:
        request = trainer_pb2.LoadCheckpointRequest.FromString(payload)
        blob = engine.load_checkpoint(Path(request.path))
        version = engine.policy_version
        return trainer_pb2.LoadCheckpointResponse(
            step=version, policy_version=version, controller_state=blob
        ).SerializeToString()

    def export(payload: bytes) -> bytes:
        request = trainer_pb2.ExportHFRequest.FromString(payload)
        files = engine.export_hf(Path(request.path))
        return trainer_pb2.ExportHFResponse(path=request.path, files=files).SerializeToString()

    def digest(_payload: bytes) -> bytes:
        sha256 = engine.parameters_digest()
        version = engine.policy_version
        return trainer_pb2.ParametersDigestResponse(
            policy_version=version, step=version, sha256=sha256
        ).SerializeToString()

    loop.register_cancellable(TRAIN, train)
    loop.register(SAVE_CHECKPOINT, save)
    loop.register(LOAD_CHECKPOINT, load)
    loop.register(EXPORT_HF, export)
    loop.register(PARAMETERS_DIGEST, digest)


class WeightPublishing:
    """This rank's :class:`~podrl.weights.Publisher` (rank 0's also assembles the manifest);
    ``ack_timeout``: how long an optimizer step waits for the acknowledgement of a version
    published from the live GPU parameters (``trainer.weights_ack_timeout_seconds``)."""

    def __init__(
        self, engine: TrainerEngine, *, rank: int, publisher_id: str, ack_timeout: float
    ) -> None:
        self.engine = engine
        self.rank = rank
        # Only rank 0 assembles (and signs); it creates the key file if the pod has none yet.
        assembler = ManifestAssembler(publisher_id, load_trainer_key()) if rank == 0 else None
        self.publisher: Publisher = WeightPublisher(engine.model, rank=rank, assembler=assembler)
        self.ack_timeout = ack_timeout
        engine.optimizer.register_step_pre_hook(self._before_optimizer_step)
        engine.train_gates.append(self._check_can_train)

    def _check_can_train(self) -> None:
        """Refuse a Train up front while published GPU parameters await their acknowledgement:
        the ack travels through the same rank command loop that a running Train occupies, so
        waiting inside the step could only time out."""
        if self.publisher.must_wait_before_step:
            raise TrainNotAllowedError(
                f"version {self.publisher.pending_version} was published from the live GPU "
                "parameters and is not acknowledged; call AcknowledgeWeights after ApplyWeights"
            )

    def _before_optimizer_step(self, *_: object) -> None:
        if self.publisher.must_wait_before_step and not self.publisher.wait_for_acknowledgement(
            self.ack_timeout
        ):
            raise TimeoutError(
                f"version {self.publisher.pending_version} was published from the live GPU "
                f"parameters and not acknowledged within {self.ack_timeout:.0f} s; the "
                "optimizer may not overwrite them (call AcknowledgeWeights after ApplyWeights)"
            )

    def publish(self, payload: bytes) -> bytes:
        """Every rank: start the version on this rank's shards; rank 0 assembles (update) and
        returns the PublishWeightsResponse."""
        request = trainer_pb2.PublishWeightsRequest.FromString(payload)
        # The train state's attribute, not the engine's property: a sync runs no engine code.
        version = self.engine.train_state.policy_version
        # A forward without backward (e.g. logits for a check) leaves FSDP2's root unsharded,
        # with the module's parameters swapped for gathered copies: publish the sharded ones.
        for module in self.engine.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        self._require_finite_everywhere(version)
        part = self.publisher.start(version, ack_timeout=0.0, check_finite=False)
        several = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        parts = gather_publications(part) if several else [part]
        if self.rank != 0:
            return b""
        manifest = self.publisher.update(version, parts, force_full=request.force_full)
        return trainer_pb2.PublishWeightsResponse(manifest=manifest).SerializeToString()

    def _require_finite_everywhere(self, version: int) -> None:
        """Every rank: raise PublishError if any rank's shards hold NaN or infinity (each rank
        checks its own; the verdicts travel to every rank, so all refuse alike and none waits
        in the gather below)."""
        bad = self.publisher.non_finite_parameter()
        verdicts = [(self.rank, bad or "")]
        # One rank needs no exchange (on CUDA it would also cost a device synchronisation).
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            flags = torch.tensor([int(bad is not None)], dtype=torch.int32)
            if torch.distributed.get_backend() == "nccl":
                flags = flags.cuda()
            torch.distributed.all_reduce(flags)
            if not int(flags.item()):
                return
            # Rare path: gather every rank's parameter name so the error names them.
            names = gather_bytes((bad or "").encode())
            verdicts = [(rank, name.decode()) for rank, name in enumerate(names)]
        elif bad is None:
            return
        named = [(rank, name) for rank, name in verdicts if name]
        raise PublishError(non_finite_message(version, named))

    def acknowledge(self, payload: bytes) -> bytes:
        """Every rank: release the pending version; raises AcknowledgeError (every rank alike:
        the ranks publish and acknowledge together) for any version but the pending one, a
        repeat of the last acknowledged one, or, with nothing pending, the version the trainer
        holds (the controller's align acknowledges it after a restart of either side)."""
        request = trainer_pb2.AcknowledgeWeightsRequest.FromString(payload)
        if (
            self.publisher.pending_version is None
            and request.version == self.engine.train_state.policy_version
        ):
            return b""
        self.publisher.finish(request.version)
        return b""


def register_weight_commands(
    loop: CommandLoop, engine: TrainerEngine, *, rank: int, publisher_id: str, ack_timeout: float
) -> WeightPublishing:
    """Register PUBLISH/ACK on this rank's command loop (every rank, same order)."""
    sync = WeightPublishing(engine, rank=rank, publisher_id=publisher_id, ack_timeout=ack_timeout)
    loop.register(PUBLISH_WEIGHTS, sync.publish)
    loop.register(ACKNOWLEDGE_WEIGHTS, sync.acknowledge)
    return sync


def register_commands(loop: CommandLoop, engine: TrainerEngine) -> WeightPublishing:
    """Every command of the trainer, registered identically on every rank; returns this rank's
    weight publishing (its Train gate and optimizer hook are installed)."""
    register_builtin_commands(loop, engine)
    # Weight publishing: every rank publishes its own shards.
    return register_weight_commands(
        loop,
        engine,
        rank=engine.env.rank,
        publisher_id=engine.worker_id,
        ack_timeout=engine.settings.weights_ack_timeout_seconds,
    )


# -- the gRPC service (rank 0) ---------------------------------------------------------------------


# The gRPC answer to a rank command that failed, by the failure's kind (docs/trainer.md).
_STATUS: dict[ErrorKind, grpc.StatusCode] = {
    trainer_pb2.RANK_ERROR_KIND_INTERNAL: grpc.StatusCode.INTERNAL,
    trainer_pb2.RANK_ERROR_KIND_INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    trainer_pb2.RANK_ERROR_KIND_NOT_NOW: grpc.StatusCode.FAILED_PRECONDITION,
    # Nothing changed, but the same batch on the same weights fails again.
    trainer_pb2.RANK_ERROR_KIND_NON_FINITE_STEP: grpc.StatusCode.FAILED_PRECONDITION,
    # Every rank refused the step alike: nothing changed, the batch may come again.
    trainer_pb2.RANK_ERROR_KIND_STEP_ABORTED: grpc.StatusCode.ABORTED,
    trainer_pb2.RANK_ERROR_KIND_NO_SPACE: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    @classmethod
    def build(cls, config: RunConfig, engine: TrainerEngine, loop: CommandLoop) -> TrainerServicer:
        """Rank 0's servicer: the trainer's section, and from the rest of the run config only
        the run directory (where files go by default) and the pod's id."""
        return cls(
            config.trainer,
            run_dir=Path(config.run_dir),
            worker_id=config.worker_id,
            engine=engine,
            loop=loop,
        )

    def __init__(
        self,
        settings: TrainerConfig,
        *,
        run_dir: Path,
        worker_id: str,
        engine: TrainerEngine,
        loop: CommandLoop,
    ) -> None:
        self._settings = settings
        self._run_dir = run_dir
        self._worker_id = worker_id
        self._engine = engine
        self._loop = loop
        # One collective command at a time, and a Train's version check and its step together.
        self._lock = threading.Lock()

    def _run(self, name: str, request: Message, context: grpc.ServicerContext) -> bytes:
        """Run command ``name`` on every rank; rank 0's reply payload."""
        try:
            return self._loop.run(name, request.SerializeToString())[0]
        except RankCommandError as err:
            log.error("%s", err)
            context.abort(grpc.StatusCode.INTERNAL, str(err))

    def Train(
        self, request: trainer_pb2.TrainRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainResponse:
        # Under the lock: a retry of a running Train waits for it and then gets its reply, and
        # no PublishWeights/AcknowledgeWeights lands between the gate check and the step.
        with self._lock:
            applied = self._engine.last_train
            if request.batch_id and applied is not None and applied.batch_id == request.batch_id:
                log.info(
                    "batch %r was trained already (version %d): answering its stored reply",
                    request.batch_id,
                    applied.response.policy_version,
                )
                stored = trainer_pb2.TrainResponse()
                stored.CopyFrom(applied.response)
                return stored
            try:
                if self._engine.replicated:
                    # The batch is checked inside the step, after this pod has joined the
                    # step's quorum (and healed, if it was behind the others); only the
                    # counts that contradict themselves are refused before, at once.
                    check_share_counts(request)
                    self._engine.check_gates()
                else:
                    self._engine.validate(request)
            except BatchError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"TrainRequest.{err}")
            except TrainNotAllowedError as err:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            try:
                # A replicated step waiting for its quorum gives up when the controller cancels
                # the call (a peer pod of the step was lost: docs/scaling.md).
                payloads = self._loop.run(
                    TRAIN,
                    request.SerializeToString(),
                    cancelled=lambda: not context.is_active(),
                )
            except RankCommandError as err:
                log.error("%s", err)
                if err.kind == trainer_pb2.RANK_ERROR_KIND_INVALID_REQUEST:
                    # Replicated: every rank checked the batch inside the step and refused it.
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, f"TrainRequest.{err.first_message}"
                    )
                context.abort(_STATUS[err.kind], str(err))
        replies = [trainer_pb2.TrainResponse.FromString(p) for p in payloads]
        reply = replies[0]
        # A guard, not a path the step is known to take: ranks must end at one version.
        versions = [r.policy_version for r in replies]
        if len(set(versions)) > 1:
            detail = ", ".join(
                f"rank {rank} at version {version}" for rank, version in enumerate(versions)
            )
            log.error("trainer ranks disagree after Train: %s", detail)
            context.abort(
                grpc.StatusCode.INTERNAL,
                f"trainer ranks disagree after Train ({detail}); restart the trainer from its "
                "last checkpoint",
            )
        m = reply.metrics
        log.info(
            "version %d: loss %.5f kl %.5f entropy %.4f grad_norm %.4f tokens %d",
            reply.policy_version,
            m.loss,
            m.kl,
            m.entropy,
            m.grad_norm,
            m.tokens,
        )
        return reply

    def _default_dir(self, configured: Path | None, name: str) -> Path:
        return Path(configured) if configured else self._run_dir / name

    def _roots(self, configured_field: str) -> list[tuple[str, Path]]:
        """The folders a file RPC may use: the run directory, and the folder the config field
        ``trainer.<configured_field>`` names when it is set."""
        roots = [("run_dir", self._run_dir)]
        configured = getattr(self._settings, configured_field)
        if configured:
            roots.append((f"trainer.{configured_field}", Path(configured)))
        return roots

    def _confined(
        self,
        requested: str | Path,
        configured_field: str,
        field: str,
        context: grpc.ServicerContext,
    ) -> Path:
        """``requested``'s real path under an allowed root, or INVALID_ARGUMENT naming
        ``field`` and the roots (podrl.trainer.paths)."""
        try:
            return paths.confined(requested, self._roots(configured_field), field)
        except paths.PathNotAllowedError as err:
            log.warning("refused %s", err)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))

    def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        directory = self._default_dir(self._settings.checkpoint_dir, "checkpoints")
        with self._lock:
            path = self._confined(
                request.path
                or directory / checkpoint.step_folder_name(self._engine.policy_version),
                "checkpoint_dir",
                "SaveCheckpointRequest.path",
                context,
            )
            if path.exists() and not (
                checkpoint.is_checkpoint(path) or (path.is_dir() and not any(path.iterdir()))
            ):
                # Saving replaces the folder whole: only an older checkpoint may be replaced.
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"SaveCheckpointRequest.path: {path} exists and is not a podrl checkpoint "
                    "(a save replaces the folder whole); name a new folder",
                )
            resolved = trainer_pb2.SaveCheckpointRequest(
                path=str(path), controller_state=request.controller_state
            )
            try:
                payload = resolved.SerializeToString()
                reply = self._loop.run(SAVE_CHECKPOINT, payload)[0]
            except RankCommandError as err:
                # Every rank failed (checkpoint.save agrees on the outcome); the folder is as it
                # was and the partial one is gone. A full disk is the operator's to fix.
                log.error("%s", err)
                full = any(
                    r.error_kind == trainer_pb2.RANK_ERROR_KIND_NO_SPACE
                    for r in err.errors.values()
                )
                code = grpc.StatusCode.RESOURCE_EXHAUSTED if full else _STATUS[err.kind]
                context.abort(code, str(err)[:4000])
            if not request.path:  # retention covers the folders the trainer names itself
                removed = checkpoint.prune(
                    paths.real_path(directory),
                    self._settings.checkpoint_keep_latest,
                    keep_path=path,
                )
                if removed:
                    log.info("checkpoint retention removed %s", [str(r) for r in removed])
        return trainer_pb2.SaveCheckpointResponse.FromString(reply)

    def LoadCheckpoint(
        self, request: trainer_pb2.LoadCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.LoadCheckpointResponse:
        if not request.path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoadCheckpointRequest.path is empty")
        path = self._confined(request.path, "checkpoint_dir", "LoadCheckpointRequest.path", context)
        if not checkpoint.is_checkpoint(path):
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"LoadCheckpointRequest.path: {path} is not a complete podrl checkpoint "
                f"(needs .metadata and {checkpoint.STATE_FILE})",
            )
        resolved = trainer_pb2.LoadCheckpointRequest(path=str(path))
        with self._lock:
            reply = self._run(LOAD_CHECKPOINT, resolved, context)
        return trainer_pb2.LoadCheckpointResponse.FromString(reply)

    def ExportHF(
        self, request: trainer_pb2.ExportHFRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ExportHFResponse:
        path = self._confined(
            request.path
            or self._default_dir(self._settings.export_dir, "exports")
            / f"version-{self._engine.policy_version:08d}",
            "export_dir",
            "ExportHFRequest.path",
            context,
        )
        foreign = export.foreign_entries(path)
        if foreign or (path.exists() and not path.is_dir()):
            # An export never deletes or overwrites files podrl did not write (export.py).
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"ExportHFRequest.path: {path} "
                + (
                    f"holds files a podrl export did not write ({', '.join(foreign[:5])})"
                    if foreign
                    else "is a file"
                )
                + "; export into a new or empty folder, or one an earlier export wrote",
            )
        resolved = trainer_pb2.ExportHFRequest(path=str(path))
        with self._lock:
            reply = self._run(EXPORT_HF, resolved, context)
        return trainer_pb2.ExportHFResponse.FromString(reply)

    # -- weight publishing (WeightPublishing, above) -----------------------------------------------

    def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        try:
            with self._lock:  # never between a Train's gate check and its step
                reply = self._loop.run(PUBLISH_WEIGHTS, request.SerializeToString())[0]
        except RankCommandError as err:
            # Every rank refuses alike while the previous version is unacknowledged.
            context.abort(_STATUS[err.kind], str(err))
        return trainer_pb2.PublishWeightsResponse.FromString(reply)

    def AcknowledgeWeights(
        self, request: trainer_pb2.AcknowledgeWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.AcknowledgeWeightsResponse:
        try:
            with self._lock:
                self._loop.run(ACKNOWLEDGE_WEIGHTS, request.SerializeToString())
        except RankCommandError as err:
            if err.kind == trainer_pb2.RANK_ERROR_KIND_NOT_NOW:
                # Every rank refuses alike an acknowledgement of a version that is not pending.
                context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"AcknowledgeWeightsRequest.{err.first_message}",
                )
            log.error("%s", err)
            context.abort(_STATUS[err.kind], str(err))
        return trainer_pb2.AcknowledgeWeightsResponse()

    def ParametersDigest(
        self, request: trainer_pb2.ParametersDigestRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ParametersDigestResponse:
        with self._lock:  # the parameters of one version: never while a step runs
            reply = self._run(PARAMETERS_DIGEST, request, context)
        return trainer_pb2.ParametersDigestResponse.FromString(reply)

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainerInfo:
        engine = self._engine
        applied = engine.last_train  # one attribute: batch id and reply always belong together
        return trainer_pb2.TrainerInfo(
            info=common_pb2.ServiceInfo(
                service="podrl.v1.Trainer",
                version=podrl.__version__,
                worker_id=self._worker_id,
                details={
                    "device": str(engine.device),
                    "loss_mode": self._settings.loss_mode,
                    "learning_rate": f"{engine.learning_rate:.3g}",
                    "lighthouse": self._settings.replication.lighthouse_address,
                },
            ),
            model=str(engine.model_path),
            policy_version=engine.policy_version,
            step=engine.policy_version,  # the trainer counts one number
            world_size=engine.env.world_size,
            mesh=trainer_pb2.MeshInfo(
                shape=list(engine.mesh.shape),
                dim_names=list(engine.mesh.mesh_dim_names),
                device_type=engine.device.type,
            ),
            last_batch_id=applied.batch_id if applied is not None else "",
            last_train=applied.response if applied is not None else None,
        )
