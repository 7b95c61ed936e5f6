"""docs/generator.md and docs/cuda.md state the H200 run of bench/sampling_seed.py: the share of
seeded completions that came out identical (same batch, two batches) and the seeded slowdown."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _flat(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


def test_the_docs_state_the_measured_reproducibility_of_seeded_sampling() -> None:
    run = json.loads((ROOT / "bench/results/sampling_seed_h200.json").read_text())
    same = f"{100 * run['same_batch']['identical_fraction']:.1f} %"
    split = f"{100 * run['other_batch']['identical_fraction']:.1f} %"
    slower = f"{100 * (1 - run['seeded_tokens_per_s'] / run['unseeded_tokens_per_s']):.0f} %"
    generator = _flat("docs/generator.md")
    assert f"{same} of the completions were identical run twice in one batch" in generator
    assert f"and {split} split over two batches; seeded sampling was {slower} slower" in generator
    cuda = _flat("docs/cuda.md")
    assert f"{same} came out identical when the set ran twice in one batch" in cuda
    assert f"{split} when it ran split over two batches; seeded sampling generated {slower}" in cuda
