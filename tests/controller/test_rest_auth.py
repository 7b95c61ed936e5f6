"""Who may change the run through the controller's REST API (docs/security.md, "The REST
API"): every route that is not a read needs an operator's (or the controller's) bearer token
signed with the run secret; reads stay open. Real HTTP (uvicorn), and at the end a real
controller process started by the local launcher, scaled by ``podrl scale``."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from podrl.cli.local_cluster import LocalCluster
from podrl.cli.main import main as podrl
from podrl.common.auth import CONTROLLER, OPERATOR, REST_ROLES, RunSecret
from podrl.config import load_config
from podrl.config.auth import SECRET_FILE_ENV, SECRET_VALUE_ENV
from podrl.controller.pods.scaling import LocalScaler
from podrl.controller.pods.table import PodTable
from podrl.controller.service.rest import build_rest_app
from podrl.controller.service.status import RunState
from tests.controller.rest_scaling import MAX, Serve, operator_headers, suite_secret
from tests.controller.stand_in_cluster import StandInCluster

REPLICAS = "/v1/workers/replicas"


def _put(url: str, headers: dict[str, str] | None = None, replicas: int = 3) -> httpx.Response:
    return httpx.put(f"{url}{REPLICAS}", json={"replicas": replicas}, headers=headers, timeout=5)


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _desired(url: str) -> int:
    return httpx.get(f"{url}{REPLICAS}", timeout=5).json()["desired_replicas"]


@pytest.fixture
def scaled(serve: Serve) -> tuple[str, LocalScaler]:
    scaler = LocalScaler(1)
    return serve(RunState("auth", PodTable(60), 1), scaler), scaler


def test_without_a_token_a_put_is_401_naming_the_fix_and_changes_nothing(
    scaled: tuple[str, LocalScaler], caplog: pytest.LogCaptureFixture
) -> None:
    url, scaler = scaled
    with caplog.at_level(logging.WARNING, logger="podrl.controller.service.rest"):
        reply = _put(url)
    assert reply.status_code == 401
    assert reply.headers["www-authenticate"].startswith("Bearer")
    assert "Authorization: Bearer" in reply.json()["detail"]
    assert scaler.desired_replicas() == 1 and _desired(url) == 1
    assert f"refused PUT {REPLICAS} from 127.0.0.1" in caplog.text  # the peer is logged


def test_a_bad_body_without_a_token_is_401_not_422(scaled: tuple[str, LocalScaler]) -> None:
    url, _ = scaled  # the caller learns nothing about what a valid request looks like
    reply = httpx.put(f"{url}{REPLICAS}", json={"replicas": "many"}, timeout=5)
    assert reply.status_code == 401


def test_a_malformed_body_without_a_token_is_401_not_a_parse_error(
    scaled: tuple[str, LocalScaler],
) -> None:
    """FastAPI parses a JSON body before any dependency runs; the credentials come first."""
    url, scaler = scaled
    for headers in ({"Content-Type": "application/json"}, BAD_CREDENTIALS["garbage"]):
        reply = httpx.put(
            f"{url}{REPLICAS}",
            content=b"{not json",
            headers={**headers, "Content-Type": "application/json"},
            timeout=5,
        )
        assert reply.status_code == 401, reply.text
        assert (
            "needs credentials" in reply.json()["detail"]
            or "not of the form" in (reply.json()["detail"])
        )
    assert scaler.desired_replicas() == 1


class BodyReads:
    """An ASGI wrapper that counts the body messages the app asked for, per request path."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.reads = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def counted() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                self.reads += 1
            return message

        await self.app(scope, counted, send)


def test_a_refused_request_has_its_body_never_read() -> None:
    """On every route that changes the run: without a token the body is not even read; with
    one it is, and is found malformed (so the count can see a read)."""
    app = build_rest_app(
        RunState("auth", PodTable(60), 1), None, LocalScaler(1), MAX, secret=suite_secret()
    )
    changes = [(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods
               if m not in ("GET", "HEAD")]  # fmt: skip
    assert changes
    spy = BodyReads(app)
    json = {"Content-Type": "application/json"}
    with TestClient(spy) as client:
        for method, path in changes:
            spy.reads = 0
            reply = client.request(method, path, content=b"{not json", headers=json)
            assert reply.status_code == 401 and spy.reads == 0, (method, path, spy.reads)
            reply = client.request(
                method, path, content=b"{not json", headers={**json, **operator_headers()}
            )
            assert reply.status_code == 422 and spy.reads > 0, (method, path, reply.text)


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_number_is_a_422_naming_the_field(
    scaled: tuple[str, LocalScaler], number: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Python's JSON parser takes NaN and Infinity; FastAPI's own 422 handler then raised
    encoding the echoed input (a 500 and a traceback in the controller's log)."""
    url, scaler = scaled
    headers = {**operator_headers(), "Content-Type": "application/json"}
    with caplog.at_level(logging.ERROR):
        reply = httpx.put(
            f"{url}{REPLICAS}", content=f'{{"replicas": {number}}}', headers=headers, timeout=5
        )
    assert reply.status_code == 422, reply.text
    (error,) = reply.json()["detail"]
    assert error["loc"] == ["body", "replicas"] and error["input"] == number
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert scaler.desired_replicas() == 1
    assert _put(url, operator_headers(), replicas=2).status_code == 202  # still serving


BAD_CREDENTIALS = {
    "another run's secret": _bearer(RunSecret(secrets.token_hex(32).encode(), "t").rest_token(
        OPERATOR, "podrl-scale")),
    "not bearer": {"Authorization": "Basic b3BlcmF0b3I6eA=="},
    "no mac": _bearer("operator.podrl-scale"),
    "garbage": _bearer("x" * 64),
    "mac of another claim": _bearer(
        "operator.someone-else." + suite_secret().rest_token(OPERATOR, "podrl-scale").split(".")[-1]
    ),
    # The gRPC metadata's MAC (another purpose, another key) does not open the REST API.
    "the gRPC caller MAC": _bearer(
        f"controller.local.{suite_secret().caller_mac(CONTROLLER, 'local')}"
    ),
}  # fmt: skip


@pytest.mark.parametrize("headers", BAD_CREDENTIALS.values(), ids=BAD_CREDENTIALS.keys())
def test_a_wrong_token_is_401_and_changes_nothing(
    scaled: tuple[str, LocalScaler], headers: dict[str, str]
) -> None:
    url, scaler = scaled
    reply = _put(url, headers)
    assert reply.status_code == 401, reply.text
    assert reply.json()["detail"]
    assert scaler.desired_replicas() == 1 and _desired(url) == 1


@pytest.mark.parametrize("role", ["generator", "grader", "trainer"])
def test_a_worker_role_is_403_and_changes_nothing(
    scaled: tuple[str, LocalScaler], role: str
) -> None:
    url, scaler = scaled
    reply = _put(url, _bearer(suite_secret().rest_token(role, "local-0")))
    assert reply.status_code == 403
    assert f"role {role} (local-0) may not change the run" in reply.json()["detail"]
    assert scaler.desired_replicas() == 1


@pytest.mark.parametrize("role", [OPERATOR, CONTROLLER])
def test_an_operator_or_controller_token_scales(scaled: tuple[str, LocalScaler], role: str) -> None:
    url, scaler = scaled
    reply = _put(url, _bearer(suite_secret().rest_token(role, "ops.example-1")))
    assert reply.status_code == 202
    assert scaler.desired_replicas() == 3 and _desired(url) == 3


def test_with_auth_disabled_a_put_without_a_token_scales(serve: Serve) -> None:
    scaler = LocalScaler(1)
    url = serve(RunState("auth", PodTable(60), 1), scaler, secret=None, auth_disabled=True)
    assert _put(url).status_code == 202
    assert scaler.desired_replicas() == 3


def test_an_app_built_without_the_secret_accepts_no_change(serve: Serve) -> None:
    scaler = LocalScaler(1)  # fails closed: no secret and auth not said to be off
    url = serve(RunState("auth", PodTable(60), 1), scaler, secret=None)
    assert _put(url, operator_headers()).status_code == 401
    assert scaler.desired_replicas() == 1


def test_every_route_but_reads_needs_a_token_and_every_read_is_open(
    serve: Serve,
) -> None:
    """The claim is about routes, not one path: a route added later that changes state and
    forgets the guard fails here."""
    app = build_rest_app(RunState("auth", PodTable(60), 1), None, LocalScaler(1), MAX)
    routes = [(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods]
    changes = [(m, p) for m, p in routes if m not in ("GET", "HEAD")]
    reads = [(m, p) for m, p in routes if m in ("GET", "HEAD")]
    assert ("PUT", REPLICAS) in changes
    assert {p for _, p in reads} >= {
        "/healthz", "/readyz", "/metrics", "/dashboard", "/v1/status", "/v1/workers", REPLICAS,
        "/v1/steps", "/v1/evals", "/v1/episodes/latest",
    }  # fmt: skip
    url = serve(RunState("auth", PodTable(60), 1), LocalScaler(1))
    for method, path in changes:
        reply = httpx.request(method, f"{url}{path}", json={}, timeout=5)
        assert reply.status_code == 401, (method, path)
    for method, path in reads:
        reply = httpx.request(method, f"{url}{path}", timeout=5, follow_redirects=False)
        assert reply.status_code not in (401, 403), (method, path)
        assert reply.status_code in (200, 307, 503), (method, path, reply.text)


def test_a_token_names_only_rest_roles_and_valid_ids() -> None:
    secret = suite_secret()
    with pytest.raises(ValueError, match="role must be one of"):
        secret.rest_token("admin", "x")
    with pytest.raises(ValueError, match="worker_id"):
        secret.rest_token(OPERATOR, "has space")
    for role in REST_ROLES:  # a dotted worker id survives the round trip
        assert secret.verify_rest_token(secret.rest_token(role, "a.b.c")) == (role, "a.b.c")


# ---- podrl scale ---------------------------------------------------------------------------


def test_podrl_scale_finds_no_secret_and_says_where_it_looked(
    scaled: tuple[str, LocalScaler],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, scaler = scaled
    monkeypatch.delenv(SECRET_VALUE_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run")}))
    assert podrl(["scale", "--replicas", "2", "--url", url, "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "podrl scale: 401:" in err
    assert f"no run secret found (looked in {SECRET_FILE_ENV}, {SECRET_VALUE_ENV} or " in err
    assert str(tmp_path / "run" / "run-secret") in err
    assert scaler.desired_replicas() == 1


def test_podrl_scale_with_another_runs_secret_says_which_it_used(
    scaled: tuple[str, LocalScaler],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, scaler = scaled
    monkeypatch.setenv(SECRET_VALUE_ENV, secrets.token_hex(32))
    assert podrl(["scale", "--replicas", "2", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "401: the token does not match this run's secret" in err
    assert "signed with the run secret from the environment" in err
    assert scaler.desired_replicas() == 1


def test_podrl_scale_refuses_a_short_secret_before_calling(
    scaled: tuple[str, LocalScaler],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, scaler = scaled
    monkeypatch.setenv(SECRET_VALUE_ENV, "short")
    assert podrl(["scale", "--replicas", "2", "--url", url]) == 2
    assert f"{SECRET_VALUE_ENV}: the run secret is 5 characters long" in capsys.readouterr().err
    assert scaler.desired_replicas() == 1


@pytest.fixture
def local_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[StandInCluster, Path]]:
    """``podrl up``'s launcher with the real controller process (its REST API, the secret
    file the launcher writes); the pods' processes are stand-ins (tests/controller/
    test_local_pods.py). No run secret in this test's environment: podrl scale must find the
    run's own file."""
    monkeypatch.delenv(SECRET_VALUE_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.delenv("PODRL_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)  # the built-in run dir (runs/podrl) is under it, empty
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        yaml.safe_dump({"run_dir": str(tmp_path / "run"), "controller": {"max_worker_pods": 3}})
    )
    cluster = StandInCluster(load_config(str(config_file)), str(config_file), 1, lambda _: None)
    cluster.exit_codes = {}
    cluster.start()
    try:
        deadline = time.monotonic() + 120
        while True:
            if cluster.controller is not None and cluster.controller.process.poll() is not None:
                raise AssertionError(f"the controller exited:\n{cluster.controller.log_tail()}")
            try:
                if httpx.get(f"{cluster.rest_url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("the controller's REST API did not come up")
            time.sleep(0.1)
        yield cluster, config_file
    finally:
        cluster.stop(20)


@pytest.mark.slow  # the controller is a real process (several, with the stand-in pods)
def test_podrl_scale_against_a_real_controller_with_the_runs_secret_file(
    local_controller: tuple[StandInCluster, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    cluster, config_file = local_controller
    url = cluster.rest_url
    assert isinstance(cluster, LocalCluster) and cluster.secret_file.exists()
    # Without the run's config podrl scale looks in the default run dir, finds no secret: 401.
    assert podrl(["scale", "--replicas", "2", "--url", url]) == 1
    err = capsys.readouterr().err
    assert "401:" in err and "no run secret found" in err
    assert _desired(url) == 1
    # With it, the run-secret file podrl up wrote signs the call; the launcher, reading the
    # desired count with GET only, starts the second pod.
    assert podrl(["scale", "--replicas", "2", "--url", url, "--config", str(config_file)]) == 0
    assert "desired worker pods: 2 (at most 3)" in capsys.readouterr().out
    assert _desired(url) == 2
    deadline = time.monotonic() + 30
    while len(cluster.pods) < 2:
        assert time.monotonic() < deadline, "the launcher did not start the second pod"
        cluster.supervise()
        time.sleep(0.05)
    assert sorted(cluster.running()) == ["local-0", "local-1"]
