"""The trainer's PUBLISH/ACK rank commands (registered into the trainer's rank command loop).

``publish_weights`` runs on every rank: each rank starts the version on its own shards
(:class:`~podrl.weights.Publisher` ``start``, over ``engine.model``), the ranks' protobuf bytes
are gathered to rank 0 over the model's process group (no pickle) and rank 0 assembles the
manifest (``update``), which is its reply (``PublishWeightsResponse``). ``acknowledge_weights``
finishes the published version on every rank (``finish``); an acknowledgement of another
version (never published, or not the pending one) is FAILED_PRECONDITION and releases nothing.

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
the manifest with the pod's weights key (``podrl.weights.keys``, ``PODRL_WEIGHTS_KEY_FILE``;
created by the trainer's first start in the pod when the file does not exist yet).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.distributed.fsdp import FSDPModule

from podrl.trainer.errors import TrainNotAllowedError
from podrl.v1 import trainer_pb2
from podrl.weights.distributed import gather_bytes, gather_publications
from podrl.weights.errors import PublishError
from podrl.weights.keys import load_trainer_key
from podrl.weights.lifecycle import Publisher
from podrl.weights.publisher import ManifestAssembler, WeightPublisher, non_finite_message

PUBLISH_WEIGHTS = "publish_weights"
ACKNOWLEDGE_WEIGHTS = "acknowledge_weights"


class _Loop(Protocol):
    def register(self, name: str, handler: object) -> None: ...


class _Engine(Protocol):
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    policy_version: int


class WeightPublishing:
    """This rank's :class:`~podrl.weights.Publisher` (rank 0's also assembles the manifest);
    ``ack_timeout``: how long an optimizer step waits for the acknowledgement of a version
    published from the live GPU parameters (``trainer.weights_ack_timeout_seconds``)."""

    def __init__(
        self, engine: _Engine, *, rank: int, publisher_id: str, ack_timeout: float
    ) -> None:
        self.engine = engine
        self.rank = rank
        # Only rank 0 assembles (and signs); it creates the key file if the pod has none yet.
        assembler = ManifestAssembler(publisher_id, load_trainer_key()) if rank == 0 else None
        self.publisher: Publisher = WeightPublisher(engine.model, rank=rank, assembler=assembler)
        self.ack_timeout = ack_timeout
        engine.optimizer.register_step_pre_hook(self._before_optimizer_step)
        gates = getattr(engine, "train_gates", None)
        if gates is not None:
            gates.append(self._check_can_train)

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
        version = self.engine.policy_version
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
        if self.publisher.pending_version is None and request.version == self.engine.policy_version:
            return b""
        self.publisher.finish(request.version)
        return b""


def register_weight_commands(
    loop: _Loop, engine: _Engine, *, rank: int, publisher_id: str, ack_timeout: float
) -> WeightPublishing:
    """Register PUBLISH/ACK on this rank's command loop (every rank, same order)."""
    sync = WeightPublishing(engine, rank=rank, publisher_id=publisher_id, ack_timeout=ack_timeout)
    loop.register(PUBLISH_WEIGHTS, sync.publish)
    loop.register(ACKNOWLEDGE_WEIGHTS, sync.acknowledge)
    return sync
