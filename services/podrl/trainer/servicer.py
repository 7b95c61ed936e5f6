"""gRPC Trainer service (rank 0). Each RPC that changes or reads sharded state runs on every
rank through the rank command loop; validation happens here first, so a bad request never
reaches the other ranks. PublishWeights/AcknowledgeWeights run the weight-transfer layer's
commands (``podrl.weights.trainer_commands``)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import grpc
from google.protobuf.message import Message

import podrl
from podrl.config import RunConfig
from podrl.trainer import checkpoint, commands
from podrl.trainer.batch import BatchError
from podrl.trainer.engine import TrainerEngine, TrainNotAllowedError
from podrl.trainer.rank_commands import CommandLoop, RankCommandError
from podrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)


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
        with self._lock:
            try:
                self._engine.validate(request)
            except BatchError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"TrainRequest.{err}")
            except TrainNotAllowedError as err:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            payload = self._run(commands.TRAIN, request, context)
        reply = trainer_pb2.TrainResponse.FromString(payload)
        m = reply.metrics
        log.info(
            "step %d (version %d): loss %.5f kl %.5f entropy %.4f grad_norm %.4f tokens %d",
            reply.step,
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

    def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        path = request.path or str(
            self._default_dir(self._config.trainer.checkpoint_dir, "checkpoints")
            / f"step-{self._engine.step:08d}"
        )
        resolved = trainer_pb2.SaveCheckpointRequest(
            path=str(Path(path).absolute()), controller_state=request.controller_state
        )
        with self._lock:
            reply = self._run(commands.SAVE_CHECKPOINT, resolved, context)
        return trainer_pb2.SaveCheckpointResponse.FromString(reply)

    def LoadCheckpoint(
        self, request: trainer_pb2.LoadCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.LoadCheckpointResponse:
        if not request.path:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "LoadCheckpointRequest.path is empty")
        path = Path(request.path).absolute()
        if not checkpoint.is_checkpoint(path):
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"LoadCheckpointRequest.path: {path} is not a complete podrl checkpoint "
                f"(needs .metadata and {checkpoint.STATE_FILE})",
            )
        resolved = trainer_pb2.LoadCheckpointRequest(path=str(path))
        with self._lock:
            reply = self._run(commands.LOAD_CHECKPOINT, resolved, context)
        return trainer_pb2.LoadCheckpointResponse.FromString(reply)

    def ExportHF(
        self, request: trainer_pb2.ExportHFRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ExportHFResponse:
        path = request.path or str(
            self._default_dir(self._config.trainer.export_dir, "exports")
            / f"version-{self._engine.policy_version:08d}"
        )
        resolved = trainer_pb2.ExportHFRequest(path=str(Path(path).absolute()))
        with self._lock:
            reply = self._run(commands.EXPORT_HF, resolved, context)
        return trainer_pb2.ExportHFResponse.FromString(reply)

    # -- weight publishing (podrl.weights.trainer_commands) ------------------------------------

    def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        from podrl.weights.trainer_commands import PUBLISH_WEIGHTS

        try:
            reply = self._loop.run(PUBLISH_WEIGHTS, request.SerializeToString())[0]
        except RankCommandError as err:
            # Every rank refuses alike while the previous version is unacknowledged.
            pending = any(e.startswith("PublishError") for e in err.errors.values())
            code = grpc.StatusCode.FAILED_PRECONDITION if pending else grpc.StatusCode.INTERNAL
            context.abort(code, str(err))
        return trainer_pb2.PublishWeightsResponse.FromString(reply)

    def AcknowledgeWeights(
        self, request: trainer_pb2.AcknowledgeWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.AcknowledgeWeightsResponse:
        from podrl.weights.trainer_commands import ACKNOWLEDGE_WEIGHTS

        self._run(ACKNOWLEDGE_WEIGHTS, request, context)
        return trainer_pb2.AcknowledgeWeightsResponse()

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainerInfo:
        engine = self._engine
        return trainer_pb2.TrainerInfo(
            info=common_pb2.ServiceInfo(
                service="podrl.v1.Trainer",
                version=podrl.__version__,
                worker_id=self._config.worker_id,
                details={
                    "device": str(engine.device),
                    "loss_mode": self._config.trainer.loss_mode,
                    "learning_rate": f"{engine.learning_rate:.3g}",
                },
            ),
            model=str(engine.model_path),
            policy_version=engine.policy_version,
            step=engine.step,
            world_size=engine.env.world_size,
            mesh=trainer_pb2.MeshInfo(
                shape=list(engine.mesh.shape),
                dim_names=list(engine.mesh.mesh_dim_names),
                device_type=engine.device.type,
            ),
        )
