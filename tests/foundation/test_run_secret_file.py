"""The run secret file is held to the weights key file's rules (docs/security.md, "The run
secret"): a regular file that grants nothing to group or others, never followed through a
symlink; besides, the layout of a Kubernetes secret volume as the chart mounts it (the key a
symlink to ``..data/<key>``, the file 0440 for the pod's fsGroup). A refused file stops a
service at start with exit 2, naming the variable and the fix."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from podrl.common.auth import load_run_secret
from podrl.common.processes import free_ports
from podrl.config import ConfigError
from podrl.config.auth import SECRET_FILE_ENV, AuthConfig
from tests.k8s.local_pod import write_volume_files

VALUE = secrets.token_hex(32)


def _load(path: Path) -> bytes:
    secret = load_run_secret(AuthConfig(), {SECRET_FILE_ENV: str(path)})
    assert secret is not None
    return secret.value


def _file(path: Path, mode: int, text: str = VALUE) -> Path:
    path.write_text(text + "\n")
    path.chmod(mode)
    return path


def test_a_private_file_is_read(tmp_path: Path) -> None:
    assert _load(_file(tmp_path / "run-secret", 0o600)) == VALUE.encode()
    assert _load(_file(tmp_path / "read-only", 0o400)) == VALUE.encode()


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o602], ids=oct)
def test_a_file_that_grants_group_or_others_anything_is_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(ConfigError) as err:
        _load(_file(tmp_path / "run-secret", mode))
    message = str(err.value)
    assert f"{SECRET_FILE_ENV}={tmp_path / 'run-secret'}" in message
    assert f"has mode {mode:o}" in message and "chmod 600" in message


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """Neither to /etc/passwd (the secret would be what everyone can read) nor to a private
    file: only the file itself is held to the rules."""
    for target in (Path("/etc/passwd"), _file(tmp_path / "private", 0o600)):
        link = tmp_path / f"link-to-{target.name}"
        link.symlink_to(target)
        with pytest.raises(ConfigError) as err:
            _load(link)
        assert f"{SECRET_FILE_ENV}={link}: is a symlink (to {target})" in str(err.value)
        assert "symlinks are not followed" in str(err.value)


def test_the_charts_secret_volume_is_read(tmp_path: Path) -> None:
    """The kubelet's layout (tests/k8s/local_pod.py writes it as the kubelet does), the file
    0440 as the chart's defaultMode says: its group is the pod's fsGroup."""
    volume = tmp_path / "podrl"
    write_volume_files(volume, {"run-secret": f"{VALUE}\n".encode()}, 0o440)
    assert (volume / "run-secret").is_symlink() and (volume / "..data").is_symlink()
    assert _load(volume / "run-secret") == VALUE.encode()


@pytest.mark.parametrize("mode", [0o444, 0o460, 0o404], ids=oct)
def test_a_secret_volume_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    volume = tmp_path / "podrl"
    write_volume_files(volume, {"run-secret": f"{VALUE}\n".encode()}, mode)
    with pytest.raises(ConfigError, match=f"has mode {mode:o}.*nothing to others.*defaultMode"):
        _load(volume / "run-secret")


def test_links_that_only_look_like_a_secret_volume_are_refused(tmp_path: Path) -> None:
    """``..data`` leading out of the folder (to /etc), or a key linked elsewhere than
    ``..data/<key>``: the symlink rule holds."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "..data").symlink_to("/etc")
    (outside / "passwd").symlink_to("..data/passwd")
    inside = tmp_path / "inside"
    write_volume_files(inside, {"run-secret": f"{VALUE}\n".encode()}, 0o440)
    (inside / "other").symlink_to("..data/run-secret")  # not ..data/other
    for link in (outside / "passwd", inside / "other"):
        with pytest.raises(ConfigError, match="is a symlink"):
            _load(link)


def test_a_file_too_large_to_be_a_secret_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="larger than 4096 bytes"):
        _load(_file(tmp_path / "run-secret", 0o600, "x" * 5000))


@pytest.mark.parametrize("case", ["mode 0644", "symlink to /etc/passwd"])
def test_a_service_with_an_unsafe_secret_file_exits_2_naming_the_fix(
    tmp_path: Path, case: str
) -> None:
    if case == "mode 0644":
        path, fix = _file(tmp_path / "run-secret", 0o644), "chmod 600"
    else:
        path, fix = tmp_path / "run-secret", "symlinks are not followed"
        path.symlink_to("/etc/passwd")
    port, controller_port = free_ports(2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PODRL_RUN_SECRET")}
    env.update(
        {SECRET_FILE_ENV: str(path)},
        PODRL_GRADER__GRPC_PORT=str(port),
        PODRL_GRADER__METRICS_PORT="0",
        PODRL_CONTROLLER__GRPC_PORT=str(controller_port),
    )
    done = subprocess.run(
        [sys.executable, "-m", "podrl.grader"], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert f"{SECRET_FILE_ENV}={path}" in done.stderr and fix in done.stderr
    assert "Traceback" not in done.stderr
