"""The pod's weights key file: created once, never followed through a symlink, private."""

from __future__ import annotations

import multiprocessing
import os
import stat
from multiprocessing.synchronize import Barrier
from pathlib import Path

import pytest

from podrl.weights.errors import ManifestError, ManifestErrorKind
from podrl.weights.protocol import (
    WEIGHTS_KEY_FILE_ENV,
    GeneratorKey,
    WeightsKeyError,
    create_key_file,
    load_trainer_key,
    read_key_file,
    write_fresh_key_file,
)


def _create(path: str, start: Barrier, out: multiprocessing.Queue) -> None:
    start.wait(timeout=60)  # every process calls create_key_file at the same moment
    out.put(create_key_file(Path(path)).secret)


RACERS = 4
ROUNDS = 10


def test_racing_trainers_create_one_key(tmp_path: Path) -> None:
    """Four processes create the key at once, released together by a barrier, ten times over:
    one file, one key for all, mode 0600, no temporary file left. (A create that checks for the
    file and then writes it gives the racers different keys: checked with such a create.)"""
    context = multiprocessing.get_context("fork")  # no re-import per racer: they start together
    for round_ in range(ROUNDS):
        path = tmp_path / f"round-{round_}" / "weights-key"
        path.parent.mkdir()
        start, out = context.Barrier(RACERS), context.Queue()
        processes = [
            context.Process(target=_create, args=(str(path), start, out)) for _ in range(RACERS)
        ]
        for process in processes:
            process.start()
        keys = {out.get(timeout=60) for _ in processes}
        for process in processes:
            process.join(timeout=60)
        assert len(keys) == 1, f"round {round_}: {len(keys)} different keys"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert sorted(p.name for p in path.parent.iterdir()) == ["weights-key"]
        assert read_key_file(path).secret == keys.pop()


def test_a_fresh_key_replaces_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "weights-key"
    first = write_fresh_key_file(path)
    second = write_fresh_key_file(path)
    assert first.secret != second.secret == read_key_file(path).secret
    assert create_key_file(path).secret == second.secret  # an existing key is kept


def test_unsafe_key_files_are_refused_naming_the_variable(tmp_path: Path) -> None:
    real = tmp_path / "real"
    write_fresh_key_file(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(WeightsKeyError, match=WEIGHTS_KEY_FILE_ENV):
        read_key_file(link)
    os.chmod(real, 0o640)
    with pytest.raises(WeightsKeyError, match="chmod 600"):
        read_key_file(real)
    short = tmp_path / "short"
    short.write_text("abcd\n")
    short.chmod(0o600)
    with pytest.raises(WeightsKeyError, match="at least 32"):
        read_key_file(short)
    with pytest.raises(WeightsKeyError, match="is not a regular file"):
        read_key_file(tmp_path)


def test_the_trainer_creates_the_key_and_the_generator_reads_it_later(tmp_path: Path) -> None:
    path = tmp_path / "weights-key"
    env = {WEIGHTS_KEY_FILE_ENV: str(path)}
    generator = GeneratorKey(env)
    with pytest.raises(ManifestError, match="trainer writes it") as refused:
        generator.get()  # before the trainer started: refused, not waited for
    assert refused.value.kind is ManifestErrorKind.UNAUTHENTIC
    trainer = load_trainer_key(env)
    assert trainer is not None and trainer.owner_uid == os.geteuid()
    assert generator.get().secret == trainer.secret


def test_without_the_variable_the_trainer_signs_nothing_and_the_generator_takes_nothing() -> None:
    assert load_trainer_key({}) is None
    with pytest.raises(ManifestError, match=f"{WEIGHTS_KEY_FILE_ENV} is not set"):
        GeneratorKey({}).get()
