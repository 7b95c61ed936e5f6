"""A model folder the service cannot read or write is a ConfigError naming the field (exit 2 with
the fix), never a bare OSError that crashes the container.

The checks run in processes with the containers' privileges (tests/k8s/local_pod.py: no
capabilities), so a read-only folder binds them even when the tests run as root."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from podrl.common.processes import free_ports
from tests.k8s.local_pod import VENV_BIN, make_read_only, make_writable, run_contained

ENSURE = """
import sys
from pathlib import Path
from podrl.models.folders import ModelFolderError, ensure_model_folder
try:
    ensure_model_folder(Path(sys.argv[1]), sys.argv[2] == "tiny", "generator.model_path")
except ModelFolderError as err:
    print(err)
    raise SystemExit(3)
print("ok")
"""


def _ensure(path: Path, tiny: bool) -> tuple[int, str]:
    """(exit code, what the script printed); stderr only on an unexpected failure."""
    done = run_contained(
        [sys.executable, "-c", ENSURE, str(path), "tiny" if tiny else "no"],
        capture_output=True,
        timeout=300,
    )
    return done.returncode, done.stdout if done.returncode in (0, 3) else done.stderr


@pytest.fixture
def read_only_folder(tmp_path: Path):
    folder = tmp_path / "ro"
    folder.mkdir()
    make_read_only(folder)
    yield folder
    make_writable(folder)


def test_tiny_model_into_a_read_only_folder_is_a_config_error_naming_the_field(
    read_only_folder: Path,
) -> None:
    code, out = _ensure(read_only_folder / "models" / "tiny", tiny=True)
    assert code == 3, out
    assert out.startswith("generator.model_path: ")
    assert "cannot be written" in out and "Permission denied" in out
    assert not (read_only_folder / "models").exists()


def test_a_folder_without_a_model_is_refused_unless_the_tiny_model_is_asked_for(
    tmp_path: Path,
) -> None:
    code, out = _ensure(tmp_path / "empty", tiny=False)
    assert code == 3 and "has no config.json" in out, out
    code, out = _ensure(tmp_path / "tiny", tiny=True)
    assert (code, out.strip()) == (0, "ok")
    assert (tmp_path / "tiny" / "config.json").is_file()
    code, out = _ensure(tmp_path / "tiny", tiny=False)  # present: used, nothing written
    assert (code, out.strip()) == (0, "ok")


def test_an_unreadable_model_folder_is_a_config_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        code, out = _ensure(locked / "model", tiny=False)
    finally:
        locked.chmod(0o700)
    assert code == 3, out
    assert out.startswith("generator.model_path: cannot read") and "Permission denied" in out


def test_the_generator_exits_2_naming_the_field_when_it_cannot_write_its_model(
    read_only_folder: Path, tmp_path: Path
) -> None:
    """The chart's old default: no model, the tiny model under a folder the generator cannot
    write (its read-only root). The service stops with exit 2 and the field, no traceback."""
    grpc_port, controller_port = free_ports(2)
    env = {
        "PATH": f"{VENV_BIN}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PODRL_RUN_DIR": str(read_only_folder / "runs" / "podrl"),
        "PODRL_GENERATOR__GRPC_PORT": str(grpc_port),
        "PODRL_GENERATOR__METRICS_PORT": "0",
        "PODRL_CONTROLLER__GRPC_PORT": str(controller_port),
        "PODRL_LOG__FORMAT": "text",
        # The model folder is checked before anyone calls; no run secret is needed for that.
        "PODRL_AUTH__DISABLED": "true",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    done = run_contained(
        [str(VENV_BIN / "podrl-generator")], env=env, capture_output=True, timeout=300
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "podrl-generator: generator.model_path: " in done.stderr
    assert "Traceback" not in done.stderr
