"""Probe rows 39-40 of 2026-12-01 (OK rows, kept OK): the REST API answers unknown paths 404,
wrong methods 405 and malformed JSON 422, never 500, and changes nothing (real HTTP). Bad
``/v1/steps`` values (``limit``, ``since``): tests/controller/test_rest_steps.py."""

from __future__ import annotations

import httpx
import pytest

from podrl.controller.pods.scaling import LocalScaler
from podrl.controller.pods.table import PodTable
from podrl.controller.service.status import RunState
from tests.controller.rest_scaling import Serve, operator_headers

REQUESTS = [
    ("GET", "/v1/nope", 404),
    ("GET", "/v1/workers/replicas/extra", 404),
    ("PUT", "/v1/nope", 404),
    ("POST", "/v1/status", 405),
    ("DELETE", "/v1/workers/replicas", 405),
    ("POST", "/v1/workers/replicas", 405),
    ("PUT", "/v1/steps", 405),
]


@pytest.mark.parametrize(("method", "path", "code"), REQUESTS)
def test_unknown_paths_and_wrong_methods_are_404_and_405(
    serve: Serve,
    method: str,
    path: str,
    code: int,
) -> None:
    scaler = LocalScaler(1)
    url = serve(RunState("probe", PodTable(60), 1), scaler)
    reply = httpx.request(method, f"{url}{path}", headers=operator_headers(), timeout=5)
    assert reply.status_code == code
    assert scaler.desired_replicas() == 1


@pytest.mark.parametrize("body", [b"{", b"not json", b'{"replicas": 2', b"\xff\xfe"])
def test_malformed_json_is_422_and_changes_nothing(serve: Serve, body: bytes) -> None:
    scaler = LocalScaler(1)
    url = serve(RunState("probe", PodTable(60), 1), scaler)
    headers = {**operator_headers(), "Content-Type": "application/json"}
    reply = httpx.put(f"{url}/v1/workers/replicas", content=body, headers=headers, timeout=5)
    assert reply.status_code == 422, reply.text
    assert reply.json()["detail"]
    assert scaler.desired_replicas() == 1
