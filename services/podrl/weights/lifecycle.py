"""The two sides of a weight update, with vLLM's phase names (docs/weights.md, "Lifecycle").

vLLM's weight-transfer engines (``vllm.distributed.weight_transfer.base``) run an update as
``start_weight_update`` → ``update_weights`` → ``finish_weight_update`` and release their
resources in ``shutdown``. podrl's two sides follow the same lifecycle:

* **start**. Publisher: make ``version`` readable and describe this rank's shards; ``version``
  is pending. Receiver: validate the manifest, plan the copy, open every storage handle, check
  that the weights are finite.
* **update**. Publisher (rank 0): merge the ranks' parts into one signed manifest. Receiver:
  copy into the destinations.
* **finish**. Publisher: the generators applied ``version``, the storage may change again.
  Receiver: every copy is done and the trainer's storage is no longer read; the filled tensors.
* **close**. Publisher: unlink what it published. Receiver: drop the opened handles and buffers.

What a failure leaves, side by side:

* ``Publisher.start`` refuses (:class:`~podrl.weights.errors.PublishError`: the previous version
  is not finished, or the weights hold NaN or infinity): nothing becomes pending, what was
  published stays published.
* ``Receiver.start`` refuses (:class:`~podrl.weights.errors.ManifestError`): nothing was written;
  the receiver and the destinations are as they were, so the served version stays.
* ``Receiver.update`` fails part-way: the destinations are partly written (the generator serves
  no known version until a full manifest: ``podrl.generator.weight_state``'s ``needs_full``);
  the plan stays cached, so a later update of the same storage rewrites every destination.

The wire between the two sides is a ``podrl.v1.WeightManifest`` (protobuf, MAC-signed;
``podrl.weights.keys``). The shared-memory staging copy (CPU) and the CUDA IPC export of the
live parameters (GPU) both sit behind :class:`Publisher`; a :class:`Receiver` opens either kind
of storage handle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from podrl.v1 import weights_pb2


@dataclass
class RankPublication:
    """What one rank contributes to a manifest: its storage fingerprint and its shards."""

    rank: int
    fingerprint: str
    shards: list[weights_pb2.TensorShard]

    def to_bytes(self) -> bytes:
        """Serialized as a ``WeightManifest`` message (protobuf, never pickle)."""
        message = weights_pb2.WeightManifest(
            model_fingerprint=self.fingerprint, shards=self.shards, publisher_id=str(self.rank)
        )
        return message.SerializeToString()

    @classmethod
    def from_bytes(cls, data: bytes) -> RankPublication:
        message = weights_pb2.WeightManifest.FromString(data)
        return cls(
            rank=int(message.publisher_id),
            fingerprint=message.model_fingerprint,
            shards=list(message.shards),
        )


@dataclass
class CopiedWeights:
    """Result of one update: iterate it for (name, tensor) pairs in the layout's naming."""

    version: int
    """The manifest's version (what the tensors now hold)."""
    plan_cached: bool
    seconds: float
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


class Publisher(ABC):
    """Trainer side: one per trainer rank; the phases are in the module docstring.

    A rank of several calls :meth:`start` on every rank, gathers the parts to rank 0 (podrl's
    ``podrl.weights.distributed``), and rank 0 calls :meth:`update` and answers with the
    manifest. :meth:`finish` runs on every rank when the generators acknowledge.
    """

    @abstractmethod
    def start(
        self, version: int, *, ack_timeout: float = 0.0, check_finite: bool = True
    ) -> RankPublication:
        """Make ``version`` readable and describe this rank's shards; ``version`` is pending.

        Waits up to ``ack_timeout`` seconds for the previous version's :meth:`finish` and
        raises :class:`~podrl.weights.errors.PublishError` if it does not come (starting the
        pending version again is allowed, e.g. a full manifest for a new generator). Raises
        ``PublishError`` naming a parameter that holds NaN or infinity (``check_finite``; a
        caller that checked every rank already passes False). On either refusal nothing
        becomes pending.
        """

    @abstractmethod
    def update(
        self, version: int, parts: Sequence[RankPublication], *, force_full: bool = False
    ) -> weights_pb2.WeightManifest:
        """Rank 0: merge every rank's part into one signed manifest, full when the storage
        changed since the last one (or ``force_full``), else version-only."""

    @abstractmethod
    def finish(self, version: int) -> None:
        """The generators applied ``version``: the storage may change again."""

    @abstractmethod
    def close(self) -> None:
        """Release what was published (shared-memory segments are unlinked)."""

    @property
    @abstractmethod
    def pending_version(self) -> int | None:
        """The version started and not finished yet, if any."""

    @property
    @abstractmethod
    def must_wait_before_step(self) -> bool:
        """True while the optimizer may not touch the parameters (the generators read the live
        parameters, and a version is pending)."""

    @abstractmethod
    def wait_for_acknowledgement(self, timeout: float | None = None) -> bool:
        """Block until no version is pending; False on timeout."""

    @abstractmethod
    def non_finite_parameter(self) -> str | None:
        """The name of a parameter of this rank holding NaN or infinity, or None."""


class Receiver(ABC):
    """Generator side: one per model replica (one generator worker); the phases are in the
    module docstring. :meth:`apply` runs the three for a caller with nothing to do between."""

    @abstractmethod
    def start(
        self,
        manifest: weights_pb2.WeightManifest,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Check ``manifest`` and get every source ready to copy into ``destinations`` (name ->
        tensor in the layout's naming; without them, buffers the receiver owns). Raises
        :class:`~podrl.weights.errors.ManifestError` with nothing written."""

    @abstractmethod
    def update(self) -> None:
        """Copy the started manifest's weights; returns when every copy has finished."""

    @abstractmethod
    def finish(self) -> CopiedWeights:
        """End the update: the trainer's storage is no longer read; the filled tensors."""

    @abstractmethod
    def close(self) -> None:
        """Drop the opened handles and the buffers."""

    def apply(
        self,
        manifest: weights_pb2.WeightManifest,
        destinations: Mapping[str, torch.Tensor] | None = None,
    ) -> CopiedWeights:
        """start → update → finish."""
        self.start(manifest, destinations)
        self.update()
        return self.finish()
