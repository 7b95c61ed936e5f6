"""docker-compose.yaml gives every podrl service the run secret (services refuse to start
without one), from the user's PODRL_RUN_SECRET, and compose refuses to start without it; the
one-shot services that write the tiny model get none."""

from __future__ import annotations

import re

import yaml

from podrl.common.auth import load_run_secret
from podrl.config import load_config
from podrl.tools.render_k8s import REPO_ROOT

REQUIRED = re.compile(r"^\$\{PODRL_RUN_SECRET:\?[^$}]+\}$")  # compose: error when unset


def test_every_service_gets_the_run_secret_from_the_environment() -> None:
    doc = yaml.safe_load((REPO_ROOT / "docker-compose.yaml").read_text())
    config_file = REPO_ROOT / doc["configs"]["run-config"]["file"]
    for name, service in doc["services"].items():
        env = {k: str(v) for k, v in service["environment"].items()}
        if name.startswith("model"):  # writes the tiny model, talks to no service
            assert "PODRL_RUN_SECRET" not in env, name
            continue
        assert REQUIRED.match(env.get("PODRL_RUN_SECRET", "")), name
        # What the container sees once compose substituted the user's value: a usable secret.
        env["PODRL_RUN_SECRET"] = "0123456789abcdef" * 4
        config = load_config(config_file, env)
        assert not config.auth.disabled, name
        assert load_run_secret(config.auth, env) is not None, name
