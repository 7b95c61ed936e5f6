"""The environments section: each limit refused with its field named (the episode length
coupled to the model length: tests/foundation/test_config_coupling.py), plug-ins and their
params checked at start, and the service as its own process (a bad plug-in: exit 2 naming the
field; SIGTERM: exit 0, its workers gone)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import psutil
import pytest
import yaml

from podrl.common.processes import free_port
from podrl.config import ConfigError, coupling, load_config
from podrl.config.environments import EnvironmentsConfig
from podrl.environments.builtins import BUILTIN_ENVIRONMENTS
from podrl.environments.isolation import resolve_environments
from podrl.v1 import common_pb2, environment_pb2_grpc
from tests.environments.conftest import FAULTY
from tests.foundation.run_secret import authed_channel


def load(tmp_path: Path, config: dict[str, object]) -> object:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path, env={})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_turns", 0),
        ("max_episode_tokens", 1),
        ("step_timeout_seconds", 0),
        ("max_tool_output_chars", 0),
        ("worker_memory_mib", 64),
        ("max_state_bytes", 10),
        ("max_sessions", 0),
        ("episodes_in_flight", 0),
        ("plugins", {"mine": "not an import path"}),
    ],
)
def test_each_limit_is_refused_naming_its_field(tmp_path: Path, field: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, {"environments": {field: value}})
    assert f"environments.{field}" in str(err.value)
    assert f"PODRL_ENVIRONMENTS__{field.upper()}" in str(err.value)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"plugins": {"mine": "tests.environments.no_such_module:Env"}},
            "environments.plugins['mine']: cannot load",
        ),
        (
            {"plugins": {"mine": "tests.environments.faulty_environments:NoStep"}},
            "environments.plugins['mine']: 'tests.environments.faulty_environments:NoStep' is "
            "not such a class",
        ),
        ({"plugins": {"calculator": FAULTY}}, "'calculator' is a built-in environment"),
        (
            {"plugins": {"mine": "tests.environments.faulty_environments:HIDDEN"}},
            "environments.plugins['mine']: 'tests.environments.faulty_environments:HIDDEN' "
            "cannot be sent to a worker process",
        ),
        ({"params": {"chess": {}}}, "environments.params: no environment is named ['chess']"),
        (
            {"params": {"guess_number": {"highest": 10}}},
            "environments.params['guess_number']: built-in",
        ),
        (
            {"plugins": {"mine": FAULTY}, "params": {"mine": {"reply": "x", "extra": 1}}},
            "environments.params['mine']: " + FAULTY,
        ),
    ],
)
def test_environments_are_checked_at_start(section: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_environments(EnvironmentsConfig.model_validate(section))
    assert message in str(err.value)


def test_params_reach_the_environment_class() -> None:
    specs = resolve_environments(
        EnvironmentsConfig(plugins={"mine": FAULTY}, params={"guess_number": {"high": 10}})
    )
    assert specs["guess_number"].params == {"high": 10}
    assert (specs["mine"].path, specs["mine"].source) == (FAULTY, FAULTY)
    assert specs["calculator"].path == "podrl.environments.builtins:Calculator"


def start_service(tmp_path: Path, environments: dict[str, object]) -> subprocess.Popen[str]:
    path = tmp_path / "run.yaml"
    section = {"metrics_port": 0, **environments}
    path.write_text(yaml.safe_dump({"environments": section}))
    return subprocess.Popen(
        [sys.executable, "-m", "podrl.environments", "--config", str(path)],
        env={**os.environ, "PODRL_LOG__FORMAT": "text"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_bad_plugin_stops_the_service_with_exit_2(tmp_path: Path) -> None:
    process = start_service(
        tmp_path, {"grpc_port": free_port(), "plugins": {"mine": "nowhere.at_all:Env"}}
    )
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "environments.plugins['mine']: cannot load 'nowhere.at_all:Env'" in stderr
    assert "Traceback" not in stderr


def test_the_service_process_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    process = start_service(tmp_path, {"grpc_port": port, "workers": 2})
    channel = authed_channel(f"127.0.0.1:{port}")
    try:
        grpc.channel_ready_future(channel).result(timeout=60)
        stub = environment_pb2_grpc.EnvironmentStub(channel)
        assert stub.Info(common_pb2.InfoRequest()).workers == 2
        workers = psutil.Process(process.pid).children(recursive=True)
        assert workers  # the fork server and the pool's workers
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
    finally:
        channel.close()
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.parametrize("field", ["grpc_port", "metrics_port"])
def test_a_port_in_use_stops_the_service_naming_its_field(tmp_path: Path, field: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ports = {"grpc_port": free_port(), "metrics_port": free_port(), field: port}
        process = start_service(tmp_path, {**ports, "workers": 1})
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2
    assert f"environments.{field}: cannot listen on 127.0.0.1:{port}" in stderr
    assert f"PODRL_ENVIRONMENTS__{field.upper()}" in stderr
    assert "Traceback" not in stderr


def _task(**fields: object) -> dict[str, object]:
    return {
        "name": "tool",
        "source": {"kind": "procedural", "generator": "add"},
        "rewards": [{"name": "exact_match"}],
        **fields,
    }


@pytest.mark.parametrize(
    ("task", "message"),
    [
        (
            _task(environment="chess"),
            "tasks.definitions[0].environment / environments.plugins: task 'tool' names the "
            "environment 'chess', which is neither a built-in nor a plug-in (known: calculator, "
            "guess_number)",
        ),
        (
            _task(turn_stop=["</calc>"]),
            "tasks.definitions[0].turn_stop / tasks.definitions[0].environment",
        ),
    ],
)
def test_a_task_names_a_known_environment_and_turns_only_with_one(
    tmp_path: Path, task: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load(tmp_path, {"tasks": {"definitions": [task]}})
    loaded = load(
        tmp_path, {"tasks": {"definitions": [_task(environment="calculator", turn_stop=["]"])]}}
    )
    assert loaded.tasks.definitions[0].environment == "calculator"


def test_the_configs_built_in_names_are_the_services() -> None:
    assert set(coupling.BUILTIN_ENVIRONMENTS) == set(BUILTIN_ENVIRONMENTS)
