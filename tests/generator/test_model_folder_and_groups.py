"""A missing model folder stops the run naming the field, and nothing is written in its place
; what a killed service started is killed with its process group (
the launcher's part). Real processes, no vLLM engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from podrl.cli.local_cluster import Child, kill_process_group
from podrl.common.processes import free_ports
from podrl.config import load_config
from podrl.models.folders import ModelFolderError, check_model_folders, may_write_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, **generator: object):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), "generator": generator}))
    return load_config(path, {})


def test_a_random_model_is_written_only_where_the_config_asks_for_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    assert may_write_tiny_model(_config(tmp_path).generator)  # the default tiny folder
    assert not may_write_tiny_model(_config(tmp_path, model_path=str(missing)).generator)
    explicit = _config(tmp_path, model_path=str(missing), create_tiny_model_if_missing=True)
    assert may_write_tiny_model(explicit.generator)
    off = _config(tmp_path, create_tiny_model_if_missing=False)
    assert not may_write_tiny_model(off.generator)


def test_podrl_run_with_a_missing_model_path_exits_2_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """Before this check: the first run failed clearly, but the generator had written a random tiny
    model to the missing path, so the second run trained it silently. Now `podrl run` stops
    before any service starts, exit 2 naming the field, and the path stays missing."""
    missing = tmp_path / "models" / "mine"
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run_dir": str(tmp_path / "run"),
                "generator": {"model_path": str(missing)},
                "trainer": {"model_path": str(missing)},
                "loop": {"steps": 2},
            }
        )
    )
    for _ in range(2):  # the second run finds the same missing folder, not a random model
        done = subprocess.run(
            [sys.executable, "-m", "podrl.cli", "run", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
        assert done.returncode == 2, done.stderr[-2000:] + done.stdout[-2000:]
        assert "trainer.model_path" in done.stderr + done.stdout
        assert not missing.exists()
    with pytest.raises(ModelFolderError, match=r"generator\.model_path: .*create_tiny_model"):
        check_model_folders(load_config(None, {"PODRL_GENERATOR__MODEL_PATH": str(missing)}))


def test_the_generator_itself_refuses_a_missing_model_path(tmp_path: Path) -> None:
    """Started without the launcher: exit 2 naming generator.model_path, nothing written."""
    missing = tmp_path / "models" / "mine"
    grpc_port, controller_port = free_ports(2)
    env = {
        **os.environ,
        "PODRL_RUN_DIR": str(tmp_path / "run"),
        "PODRL_GENERATOR__MODEL_PATH": str(missing),
        "PODRL_GENERATOR__GRPC_PORT": str(grpc_port),
        "PODRL_GENERATOR__METRICS_PORT": "0",
        "PODRL_CONTROLLER__GRPC_PORT": str(controller_port),
        "PODRL_LOG__FORMAT": "text",
    }
    done = subprocess.run(
        [sys.executable, "-m", "podrl.generator"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "generator.model_path" in done.stderr
    assert not missing.exists()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_the_launcher_kills_what_a_dead_service_left_in_its_group(
    tmp_path: Path,
) -> None:
    """A service that started a helper process (as the generator starts vLLM's engine core)
    is SIGKILLed; the helper, in the service's process group, ignores SIGTERM and would live
    on. The launcher's kill_process_group ends it."""
    script = (
        "import subprocess, sys, time\n"
        "helper = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print(helper.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    service = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    helper = int(service.stdout.readline())
    child = Child("generator", service, tmp_path / "generator.log", "127.0.0.1:1")
    try:
        kill_process_group(child)  # the service still runs: nothing is killed
        assert _alive(helper)
        service.kill()
        service.wait(timeout=30)
        assert _alive(helper)  # what happened before: the helper outlives the service
        kill_process_group(child)
        deadline = time.monotonic() + 30  # hang guard
        while _alive(helper):
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        if _alive(helper):
            os.kill(helper, signal.SIGKILL)
        service.stdout.close()
