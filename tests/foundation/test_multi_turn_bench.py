"""bench/multi_turn.py (docs/environments.md, "Measured: multi-turn against single-turn"): the
page's figures are the committed CPU JSON's, and the CUDA run gives the engine the same
workload with the GPU's settings."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench import multi_turn

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "bench" / "results" / "multi_turn_cpu.json"
PAGE = REPO / "docs" / "environments.md"


def _rows() -> dict[str, dict]:
    return {row["row"]: row for row in json.loads(RESULT.read_text())["rows"]}


def test_the_committed_run_measured_every_row_with_the_same_tokens_per_episode() -> None:
    result = json.loads(RESULT.read_text())
    rows = _rows()
    assert list(rows) == ["single-turn", "1 turn", "2 turns", "4 turns", "8 turns"]
    tokens = result["settings"]["tokens_per_episode"]
    for row in rows.values():
        assert row["tokens_per_turn"] * row["turns"] == tokens
        # Most of each episode's budget: a turn ends early where the model samples EOS.
        assert row["generated_tokens"] >= 0.75 * tokens * row["episodes"]
    assert rows["single-turn"]["prefix_cache_hit_rate"] == 0.0  # new prompts: nothing cached
    assert rows["8 turns"]["prefix_cache_hit_rate"] > rows["2 turns"]["prefix_cache_hit_rate"]


def test_the_page_states_the_committed_figures() -> None:
    """Fails when docs/environments.md's sentence states other figures than the JSON's."""
    rows = _rows()
    section = re.search(
        r"\n### Measured: multi-turn against single-turn\n(.*?)\n#", PAGE.read_text(), re.S
    )
    assert section, "docs/environments.md lost its section on the multi-turn bench"
    stated = " ".join(section.group(1).split())
    for name in ("2 turns", "4 turns", "8 turns"):
        row = rows[name]
        assert f"{row['vs_single_turn']:.2f}\u00d7" in stated, (name, stated)
        assert f"{row['prefix_cache_hit_rate']:.0%}" in stated, (name, stated)


def test_the_cuda_run_gives_the_engine_the_gpus_settings_and_the_same_workload() -> None:
    args = {
        device: argparse.Namespace(device=device, episodes=16, max_model_len=1024)
        for device in ("cpu", "cuda")
    }
    cpu = multi_turn.engine_config(args["cpu"], Path("m"))
    cuda = multi_turn.engine_config(args["cuda"], Path("m"))
    assert (cpu.dtype, cuda.dtype) == ("float32", "bfloat16")
    assert cpu.enforce_eager and not cuda.enforce_eager  # CUDA graphs on the GPU
    assert cpu.max_model_len == cuda.max_model_len and cpu.max_num_seqs == cuda.max_num_seqs
