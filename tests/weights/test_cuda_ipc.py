"""CUDA IPC between two processes: GPU parameters published in place, copied into vLLM's fused
layout (bf16) on the GPU by a receiver in this process; a version-only update re-runs the plan.
Skipped without CUDA (run on the GPU machine)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from podrl.v1 import weights_pb2
from podrl.weights import ModelDescription, WeightReceiver, vllm_layout
from tests.weights.reference_layout import expected_vllm_tensors
from tests.weights.tiny_qwen3 import CONFIG

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
REPO_ROOT = Path(__file__).resolve().parents[2]


def _wait(path: Path, process: subprocess.Popen) -> weights_pb2.WeightManifest:
    deadline = time.monotonic() + 120
    while not path.exists():
        assert process.poll() is None, "publisher died"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return weights_pb2.WeightManifest.FromString(path.read_bytes())


def test_cuda_ipc_two_processes(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *sys.path])}
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.weights.cuda_publisher", str(tmp_path)],
        cwd=REPO_ROOT,
        env=env,
    )
    try:
        first = _wait(tmp_path / "manifest-1.bin", process)
        assert all(s.storage.WhichOneof("kind") == "cuda_ipc" for s in first.shards)
        torch.manual_seed(0)
        description = ModelDescription.from_hf_config(CONFIG)
        full = {n: torch.randn(s) for n, s in description.params.items()}
        receivers = {
            rank: WeightReceiver(
                description, layout=vllm_layout(description, rank, 2), dtype="bf16", device="cuda"
            )
            for rank in (0, 1)
        }
        for version, manifest, offset in ((1, first, 0.0), (2, None, 1.0)):
            if manifest is None:
                (tmp_path / "ack-1").touch()
                manifest = _wait(tmp_path / "manifest-2.bin", process)
                assert manifest.version_only
            source = {n: t + offset for n, t in full.items()}
            for rank, receiver in receivers.items():
                applied = receiver.apply(manifest)
                assert applied.plan_cached == (version == 2)
                want = expected_vllm_tensors(source, CONFIG, rank, 2)
                for name, tensor in applied:
                    assert tensor.is_cuda and tensor.dtype == torch.bfloat16
                    torch.testing.assert_close(tensor.cpu(), want[name].to(torch.bfloat16))
    finally:
        (tmp_path / "done").touch()
        process.wait(timeout=60)
