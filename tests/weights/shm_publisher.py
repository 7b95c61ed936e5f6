"""A trainer process for the cleanup tests: publishes random tensors of the small Qwen3's
shapes through shared memory, writes the manifest, then waits for a line on stdin (or a kill).

    python -m tests.weights.shm_publisher OUT_FILE
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from podrl.weights import (
    ManifestAssembler,
    ModelDescription,
    WeightPublisher,
)
from tests.harness.weights import publish_single_process
from tests.weights.tiny_qwen3 import CONFIG


def main(out_file: str) -> None:
    torch.manual_seed(0)
    description = ModelDescription.from_hf_config(CONFIG)
    params = {name: torch.randn(shape) for name, shape in description.params.items()}
    # Small segments so that the shards spread over several of them.
    publisher = WeightPublisher(lambda: params, segment_bytes=64 * 1024)
    manifest = publish_single_process(publisher, ManifestAssembler("trainer-0"), 1)
    tmp = Path(out_file + ".tmp")
    tmp.write_bytes(manifest.SerializeToString())
    tmp.rename(out_file)
    sys.stdin.readline()


if __name__ == "__main__":
    main(sys.argv[1])
