"""The weight-transfer protocol (docs/architecture.md): trainer shards -> shared-memory handles
-> generator copy plan. Imports torch, never vLLM. See docs/weights.md."""

from podrl.weights.architectures import (
    ARCHITECTURE_TABLES,
    ModelDescription,
    TargetLayout,
    TargetTensor,
    hf_layout,
    vllm_layout,
)
from podrl.weights.errors import ManifestError, ManifestErrorKind, PublishError
from podrl.weights.publisher import (
    ManifestAssembler,
    RankPublication,
    WeightPublisher,
    publish_single_process,
)
from podrl.weights.receiver import CopiedWeights, WeightReceiver

__all__ = [
    "ARCHITECTURE_TABLES",
    "CopiedWeights",
    "ManifestAssembler",
    "ManifestError",
    "ManifestErrorKind",
    "ModelDescription",
    "PublishError",
    "RankPublication",
    "TargetLayout",
    "TargetTensor",
    "WeightPublisher",
    "WeightReceiver",
    "hf_layout",
    "publish_single_process",
    "vllm_layout",
]
