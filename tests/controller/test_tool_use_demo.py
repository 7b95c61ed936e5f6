"""The tool-use demo's config (examples/tool_use.yaml) as shipped: it loads, its warm-start
teaches the episode format, and a short run of it on a real local pod plays episodes that call
the calculator, trains them and reports the evaluation's tool-call figures."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from podrl.cli.local_cluster import LocalCluster
from podrl.common.processes import free_port
from podrl.config import load_config

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "tool_use.yaml"


def test_the_demo_config_loads_as_a_calculator_task_with_held_out_prompts() -> None:
    config = load_config(DEMO, env={})
    (task,) = config.tasks.definitions
    assert task.environment == "calculator" and "</calc>" in task.turn_stop
    assert task.split.eval > 0 and task.split.warm_start > 0  # three disjoint parts
    assert config.loop.eval_prompts > 0
    assert config.trainer.model_path == config.generator.model_path


def _status(cluster: LocalCluster) -> dict[str, Any]:
    try:
        return httpx.get(f"{cluster.rest_url}/v1/status", timeout=5).json()
    except httpx.HTTPError:
        return {}


@pytest.mark.slow
def test_a_short_run_of_the_demo_plays_tool_calls_end_to_end(tmp_path: Path) -> None:
    from podrl.models.tiny import make_tiny_model
    from podrl.trainer.warm_start import warm_start

    raw = yaml.safe_load(DEMO.read_text())
    warm = tmp_path / "warm"
    raw["run_dir"] = str(tmp_path / "run")
    raw["trainer"]["model_path"] = raw["generator"]["model_path"] = str(warm)
    raw["environments"]["grpc_port"] = free_port()
    raw["controller"] = {"heartbeat_interval_seconds": 0.5, "heartbeat_timeout_seconds": 3}
    raw["loop"].update(steps=2, prompts_per_step=4, eval_prompts=8, eval_every=0)
    raw["loop"]["checkpoint_every"] = 0
    path = tmp_path / "tool_use.yaml"
    path.write_text(yaml.safe_dump(raw))
    config = load_config(path, env=dict(os.environ))
    # Enough supervised steps to learn the tags (the demo's 60 also start to copy the numbers).
    warm_start(config, make_tiny_model(tmp_path / "tiny"), warm, steps=40, lr=1e-3)
    cluster = LocalCluster(config, str(path))
    cluster.start()
    try:
        cluster.wait_ready(timeout=400)
        deadline = time.monotonic() + 600
        while (status := _status(cluster)).get("phase") not in ("finished", "failed"):
            assert time.monotonic() < deadline, status
            time.sleep(0.5)
        steps = httpx.get(f"{cluster.rest_url}/v1/steps", timeout=5).json()
    finally:
        cluster.stop(grace=30, controller_first=True)
    assert status["phase"] == "finished", status.get("error")
    assert all(s["metrics"]["episodes"] == 4 * raw["loop"]["sampling"]["n"] for s in steps)
    assert sum(s["metrics"]["tool_calls"] for s in steps) > 0
    rows = [
        json.loads(line) for line in (config.run_dir / "samples.jsonl").read_text().splitlines()
    ]
    results = [t["observation"] for row in rows for t in row["turns"] if t["tool_calls"]]
    assert results and all(r.startswith("<result>") for r in results)  # the calculator answered
    summary = json.loads((config.run_dir / "summary.json").read_text())
    for evaluation in (summary["initial_eval"], summary["final_eval"]):
        tool_use = evaluation["tool_use"]  # the end table's tool-call figures
        assert tool_use["episodes"] == 8 and 0.0 <= tool_use["tool_call_rate"] <= 1.0
