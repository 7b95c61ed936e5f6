"""The weight-transfer protocol (docs/architecture.md): trainer shards -> shared-memory handles
-> generator copy plan. Imports torch, never vLLM. See docs/weights.md.

Two interfaces with vLLM's phase names (start -> update -> finish, close;
:mod:`podrl.weights.protocol`): :class:`Publisher` on the trainer, :class:`Receiver` on the
generator; :class:`WeightPublisher` and :class:`WeightReceiver` implement them."""

from podrl.weights.errors import ManifestError, ManifestErrorKind, PublishError
from podrl.weights.protocol import CopiedWeights, Publisher, RankPublication, Receiver
from podrl.weights.publisher import ManifestAssembler, WeightPublisher
from podrl.weights.receiver import (
    ARCHITECTURE_TABLES,
    ModelDescription,
    TargetLayout,
    TargetTensor,
    WeightReceiver,
    hf_layout,
    vllm_layout,
)

__all__ = [
    "ARCHITECTURE_TABLES",
    "CopiedWeights",
    "ManifestAssembler",
    "ManifestError",
    "ManifestErrorKind",
    "ModelDescription",
    "PublishError",
    "Publisher",
    "RankPublication",
    "Receiver",
    "TargetLayout",
    "TargetTensor",
    "WeightPublisher",
    "WeightReceiver",
    "hf_layout",
    "vllm_layout",
]
