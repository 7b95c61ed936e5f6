"""Experiment tracking: the TensorBoard event files read back with TensorBoard's own reader
(tensorboard's EventAccumulator), W&B in offline mode read back from its run file, and the
writer's needs (no torch, a clear error without wandb)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from podrl.config import ConfigError, RunConfig
from podrl.controller.records.recorder import StepRecord, Tracker, eval_scalars, step_scalars


def _config(run_dir: Path, **tracking: Any) -> RunConfig:
    return RunConfig.model_validate(
        {"name": "track", "run_dir": str(run_dir), "tracking": tracking}
    )


def _step(step: int, reward: float, **extra: Any) -> StepRecord:
    metrics = {
        "reward_mean": reward,
        "reward_max": 1.0,
        "reward_by_task": {"copy": reward},
        "score_errors": 0,
        "dropped_samples": 0,
        "tokens_generated": 400,
        "loss": 0.25,
        "kl": 0.01,
        "entropy": 1.5,
        "clip_fraction": 0.1,
        "grad_norm": 2.0,
        "phase_seconds": {"generate": 0.5, "score": 0.1, "train": 1.0, "sync": 0.04},
        **extra,
    }
    return StepRecord(step, step, {}, metrics, time.time())


EVALUATION = {
    "step": 2,
    "policy_version": 2,
    "accuracy": 0.75,
    "reward_mean": 0.8,
    "score_errors": 0,
    "seconds": 0.3,
    "finished_at": time.time(),
    "by_task": {"copy": {"accuracy": 0.75, "reward_mean": 0.8}},
}


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


def test_step_and_eval_scalars_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    tracker = Tracker(_config(tmp_path))
    tracker.open(0, "unused")
    tracker.log_eval({**EVALUATION, "step": 0, "accuracy": 0.25})
    tracker.log_step(_step(1, 0.5))
    # Step 2's Train reply was lost: its trainer figures are unknown (None), not 0.
    tracker.log_step(_step(2, 0.6, loss=None, grad_norm=None))
    tracker.log_eval(EVALUATION)
    tracker.close()
    scalars = _scalars(tmp_path / "tensorboard")
    assert scalars["reward/mean"] == [(1, 0.5), (2, pytest.approx(0.6))]
    assert scalars["reward/copy"] == [(1, 0.5), (2, pytest.approx(0.6))]
    assert scalars["train/loss"] == [(1, 0.25)]  # the unknown step is left out
    assert scalars["train/grad_norm"] == [(1, 2.0)]
    assert [s for s, _ in scalars["train/kl"]] == [1, 2]
    for tag in ("train/entropy", "train/clip_fraction", "time/train_seconds"):
        assert len(scalars[tag]) == 2, tag
    assert scalars["time/tokens_per_second"][0] == (1, pytest.approx(400 / 0.5))
    assert scalars["time/weight_sync_ms"][0] == (1, pytest.approx(40.0))
    assert scalars["eval/accuracy"] == [(0, 0.25), (2, 0.75)]
    assert scalars["eval/copy/accuracy"] == [(0, 0.75), (2, 0.75)]
    assert scalars["eval/reward_mean"][-1] == (2, pytest.approx(0.8))


def test_a_resumed_run_replaces_the_steps_it_runs_again(tmp_path: Path) -> None:
    first = Tracker(_config(tmp_path))
    first.open(0, "unused")
    for step in range(1, 6):
        first.log_step(_step(step, 0.1 * step))
    first.close()
    # The controller died; the trainer's checkpoint was at step 3: steps 4 and 5 run again.
    second = Tracker(_config(tmp_path))
    second.open(3, "unused")
    for step in (4, 5):
        second.log_step(_step(step, 0.9))
    second.close()
    rewards = _scalars(tmp_path / "tensorboard")["reward/mean"]
    assert [s for s, _ in rewards] == [1, 2, 3, 4, 5]
    assert [v for s, v in rewards if s > 3] == [pytest.approx(0.9)] * 2


def test_no_tensorboard_writes_no_event_files(tmp_path: Path) -> None:
    tracker = Tracker(_config(tmp_path, tensorboard=False))
    tracker.open(0, "unused")
    tracker.log_step(_step(1, 0.5))
    tracker.close()
    assert tracker.tensorboard_dir is None
    assert not (tmp_path / "tensorboard").exists()


def test_the_writer_loads_no_torch(tmp_path: Path) -> None:
    """torch is installed here; the controller's tracking must not import it (tensorboardX
    would, if it could)."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from podrl.config import RunConfig\n"
        "from podrl.controller.records.recorder import Tracker\n"
        f"config = RunConfig.model_validate({{'run_dir': {str(tmp_path)!r}}})\n"
        "tracker = Tracker(config)\n"
        "tracker.open(0, 'x')\n"
        "tracker.close()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('torch') is not None  # it was there to be imported\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_figures_that_are_not_numbers_are_left_out() -> None:
    scalars = step_scalars({"reward_mean": None, "trained": True, "phase_seconds": {}})
    assert scalars == {}
    assert eval_scalars({"step": 3, "accuracy": None, "error": "generator down"}) == {}


def _wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of a W&B run file (a LevelDB-style log of protobuf Records: a 7-byte
    header, then records of crc32, length, type, data in 32 KiB blocks)."""
    import json

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 2:  # first part of a record spanning blocks
            pending = chunk
            continue
        if kind == 3:  # middle
            pending += chunk
            continue
        payload = pending + chunk if kind == 4 else chunk
        pending = b""
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            history = record.history
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in history.item}
            rows.append({**row, "_step": history.step.num})
    return rows


def test_wandb_offline_run_holds_the_scalars(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    config = _config(tmp_path, wandb={"project": "podrl-test", "mode": "offline"})
    tracker = Tracker(config)
    tracker.open(0, "track-test1")
    tracker.log_step(_step(1, 0.5))
    tracker.log_eval({**EVALUATION, "step": 1})
    tracker.close()
    [run_file] = (tmp_path / "wandb").glob("offline-run-*-track-test1/run-track-test1.wandb")
    rows = [
        row for row in _wandb_history(run_file) if "reward/mean" in row or "eval/accuracy" in row
    ]
    assert rows and all(row["_step"] == 1 for row in rows)
    logged = {key: value for row in rows for key, value in row.items()}
    assert logged["reward/mean"] == 0.5
    assert logged["train/loss"] == 0.25
    assert logged["eval/accuracy"] == 0.75


def test_wandb_configured_but_not_installed_is_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails
    config = _config(tmp_path, wandb={"project": "p", "mode": "offline"})
    with pytest.raises(ConfigError, match=r"tracking\.wandb .* pip install wandb"):
        Tracker(config)
    # Disabled W&B needs no package.
    Tracker(_config(tmp_path, wandb={"project": "p", "mode": "disabled"})).close()


def test_policy_drift_figures_are_scalars_and_unknown_ones_left_out(tmp_path: Path) -> None:
    tracker = Tracker(_config(tmp_path))
    tracker.open(0, "unused")
    drift = {"mismatch_kl": 0.002, "update_ratio": 3e-5, "behaviour_age_max": 1}
    tracker.log_step(_step(1, 0.5, **drift, clip_fraction_dual=0.01, is_weight_max=1.5))
    # Step 2's drift figures are unknown (a lost Train reply): no point, never 0.
    tracker.log_step(_step(2, 0.6, **dict.fromkeys(drift), behaviour_age_mean=0.5))
    tracker.close()
    scalars = _scalars(tmp_path / "tensorboard")
    assert scalars["train/mismatch_kl"] == [(1, pytest.approx(0.002))]
    assert scalars["train/update_ratio"] == [(1, pytest.approx(3e-5))]
    assert scalars["train/behaviour_age_max"] == [(1, 1.0)]
    assert scalars["train/behaviour_age_mean"] == [(2, 0.5)]
    assert scalars["train/clip_fraction_dual"] == [(1, pytest.approx(0.01))]
    assert scalars["train/is_weight_max"] == [(1, 1.5)]
