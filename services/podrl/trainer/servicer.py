"""gRPC Trainer service (rank 0). Each RPC that changes or reads sharded state runs on every
rank through the rank command loop; validation happens here first, so a bad request never
reaches the other ranks. PublishWeights/AcknowledgeWeights run this rank's weight publishing
(``podrl.trainer.rank_commands``' ``WeightPublishing``) on every rank, never the engine.

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
from pathlib import Path

import grpc
from google.protobuf.message import Message

import podrl
from podrl.config import RunConfig
from podrl.trainer import checkpoint, export, paths, rank_commands
from podrl.trainer.batch import BatchError, check_share_counts
from podrl.trainer.engine import TrainerEngine
from podrl.trainer.errors import ErrorKind, TrainNotAllowedError
from podrl.trainer.rank_commands import CommandLoop, RankCommandError
from podrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)

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
    def __init__(self, config: RunConfig, engine: TrainerEngine, loop: CommandLoop) -> None:
        self._config = config
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
                    rank_commands.TRAIN,
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
        return Path(configured) if configured else Path(self._config.run_dir) / name

    def _roots(self, configured_field: str) -> list[tuple[str, Path]]:
        """The folders a file RPC may use: the run directory, and the folder the config field
        ``trainer.<configured_field>`` names when it is set."""
        roots = [("run_dir", Path(self._config.run_dir))]
        configured = getattr(self._config.trainer, configured_field)
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
        directory = self._default_dir(self._config.trainer.checkpoint_dir, "checkpoints")
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
                reply = self._loop.run(rank_commands.SAVE_CHECKPOINT, payload)[0]
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
                    self._config.trainer.checkpoint_keep_latest,
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
            reply = self._run(rank_commands.LOAD_CHECKPOINT, resolved, context)
        return trainer_pb2.LoadCheckpointResponse.FromString(reply)

    def ExportHF(
        self, request: trainer_pb2.ExportHFRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ExportHFResponse:
        path = self._confined(
            request.path
            or self._default_dir(self._config.trainer.export_dir, "exports")
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
            reply = self._run(rank_commands.EXPORT_HF, resolved, context)
        return trainer_pb2.ExportHFResponse.FromString(reply)

    # -- weight publishing (podrl.trainer.rank_commands' WeightPublishing) ------------------------

    def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        try:
            with self._lock:  # never between a Train's gate check and its step
                reply = self._loop.run(rank_commands.PUBLISH_WEIGHTS, request.SerializeToString())[
                    0
                ]
        except RankCommandError as err:
            # Every rank refuses alike while the previous version is unacknowledged.
            context.abort(_STATUS[err.kind], str(err))
        return trainer_pb2.PublishWeightsResponse.FromString(reply)

    def AcknowledgeWeights(
        self, request: trainer_pb2.AcknowledgeWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.AcknowledgeWeightsResponse:
        try:
            with self._lock:
                self._loop.run(rank_commands.ACKNOWLEDGE_WEIGHTS, request.SerializeToString())
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
            reply = self._run(rank_commands.PARAMETERS_DIGEST, request, context)
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
                worker_id=self._config.worker_id,
                details={
                    "device": str(engine.device),
                    "loss_mode": self._config.trainer.loss_mode,
                    "learning_rate": f"{engine.learning_rate:.3g}",
                    "lighthouse": self._config.trainer.replication.lighthouse_address,
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
