"""The trainer's rank commands: each RPC that needs every rank is one entry in this table.

Handlers run on EVERY rank with the same payload (a serialized request message) and return
their rank's serialized response. Rank 0's reply is the one the servicer answers with.
To add a command (e.g. publishing weights, where every rank publishes its own shards), write a
``register_*`` function like ``register_builtin_commands`` and call it in ``register_commands``.
"""

from __future__ import annotations

from pathlib import Path

from podrl.trainer.engine import TrainerEngine
from podrl.trainer.rank_command_loop import Cancelled, CommandLoop
from podrl.trainer.weight_publishing import WeightPublishing, register_weight_commands
from podrl.v1 import trainer_pb2

TRAIN = "train"
SAVE_CHECKPOINT = "save_checkpoint"
LOAD_CHECKPOINT = "load_checkpoint"
EXPORT_HF = "export_hf"
PARAMETERS_DIGEST = "parameters_digest"


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
