"""Checkpoint folders: a folder that looks complete is complete (saves go to a hidden sibling
and are renamed into place, also over an existing checkpoint), and retention keeps the latest
``keep`` step folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from podrl.trainer.checkpoint import STATE_FILE, is_checkpoint, prune, step_folder_name
from tests.trainer.rank_worker import config_env, run_ranks


def _complete_looking(directory: Path) -> list[str]:
    return sorted(f.name for f in directory.iterdir() if f.is_dir() and is_checkpoint(f))


def _fake_checkpoint(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"m")
    (path / STATE_FILE).write_text("{}")
    return path


def test_prune_keeps_the_latest_step_folders_and_removes_leftovers(tmp_path):
    for step in (1, 2, 3, 10, 11):
        _fake_checkpoint(tmp_path / step_folder_name(step))
    _fake_checkpoint(tmp_path / "best")  # not named by the trainer: never touched
    (tmp_path / ".step-00000012.partial").mkdir()  # an interrupted save
    (tmp_path / ".step-00000003.replaced").mkdir()

    removed = prune(tmp_path, 3)

    assert sorted(p.name for p in removed) == [
        ".step-00000003.replaced",
        ".step-00000012.partial",
        "step-00000001",
        "step-00000002",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best",
        "step-00000003",
        "step-00000010",
        "step-00000011",
    ]


def test_prune_never_removes_the_folder_just_written_and_zero_keeps_all(tmp_path):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path / step_folder_name(step))
    # After a rollback the newest save can have a lower step than older folders.
    assert [p.name for p in prune(tmp_path, 1, keep_path=tmp_path / "step-00000001")] == [
        "step-00000002"
    ]
    assert _complete_looking(tmp_path) == ["step-00000001", "step-00000003"]
    assert prune(tmp_path, 0) == []
    assert _complete_looking(tmp_path) == ["step-00000001", "step-00000003"]


@pytest.mark.slow
def test_an_interrupted_save_leaves_the_previous_checkpoint_complete(tiny_model, tmp_path):
    directory = tmp_path / "checkpoints"
    target = directory / "step-00000001"
    fault = [{"point": "trainer.checkpoint_before_state", "action": "raise", "rank": 0}]
    results = run_ranks(
        1,
        config_env(str(tiny_model), str(tmp_path)),
        [
            ["train", 1],
            ["state"],  # 1: the weights saved below
            ["save", str(target), "one"],
            ["train", 2],
            ["state"],  # 4
            ["faults", json.dumps(fault)],
            ["try_save", str(target), "two"],  # 6: shards written, interrupted before the end
            ["load", str(target)],  # 7
            ["state"],  # 8
            ["train", 2],
            ["state"],  # 10
            ["save", str(target), "three"],  # 11: now over the same folder, completely
            ["train", 3],
            ["load", str(target)],  # 13
            ["state"],  # 14
        ],
        tmp_path / "out.json",
    )
    assert "checkpoint" in results[6]["error"] and "as it was before" in results[6]["error"]
    # The interrupted save replaced nothing: the folder still holds step 1, all of it.
    assert results[7] == {"blob": "one", "version": 1}
    assert results[8]["digest"] == results[1]["digest"] != results[4]["digest"]
    # The complete re-save of the same folder replaced it as a whole.
    assert results[13] == {"blob": "three", "version": 2}
    assert results[14]["digest"] == results[10]["digest"]
    assert _complete_looking(directory) == ["step-00000001"]
    assert sorted(p.name for p in directory.iterdir()) == ["step-00000001"]  # no leftovers


@pytest.mark.slow
def test_a_checkpoint_of_the_previous_state_format_loads(tiny_model, tmp_path):
    # Format 1 held the train state's keys at the top level, beside a step equal to the version.
    target = tmp_path / "checkpoints" / "step-00000001"
    results = run_ranks(
        1,
        config_env(str(tiny_model), str(tmp_path)),
        [
            ["train", 1],
            ["state"],  # 1
            ["save", str(target), "old"],
            ["to_previous_format", str(target)],
            ["train", 2],
            ["load", str(target)],  # 5
            ["state"],  # 6
            ["train", 2],
            ["state"],  # 8
        ],
        tmp_path / "out.json",
    )
    assert json.loads((target / STATE_FILE).read_text())["format"] == 1
    assert results[5] == {"blob": "old", "version": 1}
    assert results[6]["digest"] == results[1]["digest"]
    assert results[8]["version"] == 2
