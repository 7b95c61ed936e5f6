"""Which torchft process group carries the cross-pod all-reduce (trainer.replication.backend)."""

from __future__ import annotations

import pytest
import torch

from podrl.config import ConfigError
from podrl.trainer.replication import cross_pod_backend


def test_auto_is_nccl_for_cuda_parameters_and_gloo_for_cpu_ones() -> None:
    assert cross_pod_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert cross_pod_backend("auto", torch.device("cpu")) == "gloo"


def test_gloo_is_kept_for_cuda_parameters_of_pods_sharing_a_gpu() -> None:
    assert cross_pod_backend("gloo", torch.device("cuda", 0)) == "gloo"
    assert cross_pod_backend("nccl", torch.device("cuda", 0)) == "nccl"


def test_nccl_for_cpu_parameters_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.replication\.backend: nccl"):
        cross_pod_backend("nccl", torch.device("cpu"))
