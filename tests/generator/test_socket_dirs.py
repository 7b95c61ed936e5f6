"""vLLM's ZeroMQ socket files live in the generator's own folder, removed when it stops or,
after a kill, by the next generator or ``podrl up`` (podrl.generator.engine_processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from podrl.generator.engine_processes import (
    SOCKET_DIR_ENV,
    own_socket_dir,
    reap_dead_socket_dirs,
    remove_socket_dir,
    socket_dir_path,
)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_generator_points_vllm_at_its_own_folder_and_removes_it(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    path = own_socket_dir(environ, tmp_path)
    assert path == socket_dir_path(tmp_dir=tmp_path) and path.is_dir()
    assert environ[SOCKET_DIR_ENV] == str(path)
    assert path.stat().st_mode & 0o777 == 0o700
    # An engine started again in the same process gets its folder back after a removal.
    remove_socket_dir(path)
    assert not path.exists()
    assert own_socket_dir(environ, tmp_path) == path and path.is_dir()


def test_a_folder_the_user_set_is_kept(tmp_path: Path) -> None:
    environ = {SOCKET_DIR_ENV: str(tmp_path / "mine")}
    assert own_socket_dir(environ, tmp_path) is None
    assert environ[SOCKET_DIR_ENV] == str(tmp_path / "mine")


def test_only_real_folders_of_generators_that_are_gone_are_reaped(tmp_path: Path) -> None:
    dead = socket_dir_path(_dead_pid(), tmp_path)
    dead.mkdir()
    (dead / "0f8e-socket").write_text("")
    alive = socket_dir_path(os.getpid(), tmp_path)
    alive.mkdir()
    target = tmp_path / "not-ours"
    target.mkdir()
    symlink = socket_dir_path(_dead_pid(), tmp_path)
    symlink.symlink_to(target)
    plain_file = socket_dir_path(_dead_pid(), tmp_path)
    plain_file.write_text("")
    other = tmp_path / "podrl-vllm-notes"
    other.mkdir()

    assert reap_dead_socket_dirs(tmp_path) == [dead.name]
    assert not dead.exists()
    assert alive.is_dir() and target.is_dir() and symlink.is_symlink()
    assert plain_file.is_file() and other.is_dir()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_kept(tmp_path: Path) -> None:
    theirs = socket_dir_path(_dead_pid(), tmp_path)
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)  # nobody
    assert reap_dead_socket_dirs(tmp_path) == []
    assert theirs.is_dir()
