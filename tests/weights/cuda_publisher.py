"""A CUDA trainer process for test_cuda_ipc: publishes the small Qwen3's weights straight from
GPU memory (CUDA IPC, no staging), bumps them by 1.0 after ``ack-1`` and publishes version 2."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from podrl.weights import ManifestAssembler, ModelDescription, WeightPublisher
from tests.harness.weights import publish_single_process
from tests.weights.tiny_qwen3 import CONFIG


def main(out_dir: str) -> None:
    out = Path(out_dir)
    torch.manual_seed(0)
    description = ModelDescription.from_hf_config(CONFIG)
    params = {n: torch.randn(s).cuda() for n, s in description.params.items()}
    publisher = WeightPublisher(lambda: params)
    assembler = ManifestAssembler("trainer-0")
    for version in (1, 2):
        if version == 2:
            while not (out / "ack-1").exists():
                time.sleep(0.02)
            # Published from the live GPU tensors: the step must wait for the ack.
            assert publisher.must_wait_before_step and publisher.pending_version == 1
            publisher.finish(1)
            for tensor in params.values():
                tensor.add_(1.0)  # the optimizer step, in place
        update = publish_single_process(publisher, assembler, version)
        (out / f"m{version}.tmp").write_bytes(update.SerializeToString())
        (out / f"m{version}.tmp").rename(out / f"manifest-{version}.bin")
    while not (out / "done").exists():
        time.sleep(0.02)


if __name__ == "__main__":
    main(sys.argv[1])
