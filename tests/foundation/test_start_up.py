"""The run start: the trainer's and the generator's compile caches point at a folder that
survives runs (``compile_cache_dir``), and the launcher reports how long each service took to
become ready."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import podrl.cli.local_cluster as local_cluster
from podrl.cli.local_cluster import Child, LocalCluster, LocalPod, ready_line
from podrl.common.service import parse_service_args, use_compile_cache
from podrl.config import RunConfig, load_config

CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLLM_CACHE_ROOT")


def test_the_compile_caches_live_under_compile_cache_dir(tmp_path: Path) -> None:
    config = RunConfig(compile_cache_dir=tmp_path / "cache")
    assert config.compile_cache_env({}) == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "cache" / "triton"),
        "VLLM_CACHE_ROOT": str(tmp_path / "cache" / "vllm"),
    }


def test_unset_the_caches_go_to_the_users_cache_folder_and_set_variables_win(
    tmp_path: Path,
) -> None:
    env = RunConfig().compile_cache_env(
        {"XDG_CACHE_HOME": str(tmp_path), "VLLM_CACHE_ROOT": "/elsewhere"}
    )
    assert env == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "podrl" / "compile" / "inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "podrl" / "compile" / "triton"),
    }


@pytest.mark.parametrize(("service", "pointed"), [("trainer", True), ("grader", False)])
def test_the_trainer_and_the_generator_point_their_caches_there_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, service: str, pointed: bool
) -> None:
    # A copy of the environment: what the service start sets goes away with the test.
    environ = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    monkeypatch.setattr(os, "environ", environ)
    environ["PODRL_COMPILE_CACHE_DIR"] = str(tmp_path / "cache")
    environ["PODRL_AUTH__DISABLED"] = "true"
    parse_service_args(service, [])
    assert (environ.get("TORCHINDUCTOR_CACHE_DIR") == str(tmp_path / "cache" / "inductor")) is (
        pointed
    )
    assert (environ.get("VLLM_CACHE_ROOT") == str(tmp_path / "cache" / "vllm")) is pointed


def test_a_cache_folder_it_cannot_write_leaves_the_defaults_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in CACHE_VARIABLES}
    monkeypatch.setattr(os, "environ", environ)
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")  # a file where the folder should be: no user can create it
    use_compile_cache(RunConfig(compile_cache_dir=blocked), "generator")
    assert not set(CACHE_VARIABLES) & set(environ)
    warning = capsys.readouterr().err
    assert warning.startswith("podrl-generator: warning: compile_cache_dir: ")
    assert "make the folder writable" in warning


def test_the_launcher_reports_how_long_each_service_took_to_become_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = load_config(env={**os.environ, "PODRL_RUN_DIR": str(tmp_path)})
    cluster = LocalCluster(config, None)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    processes = [subprocess.Popen(sleeper) for _ in range(4)]
    try:
        names = ("controller", "generator", "grader", "trainer")
        children = {
            name: Child(name, process, tmp_path / f"{name}.log", f"127.0.0.1:{port}", name)
            for port, (name, process) in enumerate(zip(names, processes, strict=True), 1)
        }
        # The generator starts serving on the third round of probes; the rest at once.
        probes: dict[str, int] = {}

        def health(address: str, _service: str, timeout: float) -> str:
            name = names[int(address.rsplit(":", 1)[1]) - 1]
            probes[name] = probes.get(name, 0) + 1
            return "SERVING" if name != "generator" or probes[name] >= 3 else "NOT_SERVING"

        monkeypatch.setattr(local_cluster, "grpc_health", health)
        monkeypatch.setattr(local_cluster, "http_ready", lambda *_a, **_k: True)
        monkeypatch.setattr(local_cluster.time, "sleep", lambda _s: None)
        cluster.controller = children.pop("controller")
        cluster.pods = {0: LocalPod(0, {}, children)}
        assert cluster.wait_ready(timeout=30)
        times = cluster.ready_times()
        assert list(times) == list(names)
        assert all(seconds >= 0 for seconds in times.values())
        assert probes == {"controller": 1, "generator": 3, "grader": 1, "trainer": 1}
        assert times["generator"] >= times["grader"]
        line = ready_line(times)
        assert line.startswith("ready after: controller ")
        assert f"generator {times['generator']:.1f} s" in line
    finally:
        for process in processes:
            process.kill()
            process.wait()
        cluster.http.close()
