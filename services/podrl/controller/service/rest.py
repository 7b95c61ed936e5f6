"""REST API of the controller (FastAPI): probes, status, workers, scaling, Prometheus metrics.

Reading is open (probes, status, history, metrics, dashboard); every route that changes the
run (any method but GET/HEAD: today ``PUT /v1/workers/replicas``) requires a bearer token
signed with the run secret of a role in ``REST_CHANGE_ROLES`` (operator or controller): 401
without one or with a wrong one, 403 for another role (docs/security.md, "The REST API").
The route class checks the token before FastAPI reads or parses the body, so a refused caller
learns nothing about what a valid body looks like and makes the controller read no bytes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt

import podrl
from podrl.common.auth import REST_CHANGE_ROLES, Caller, RunSecret
from podrl.controller.pods.scaling import ReplicaScaler, ScaleError
from podrl.controller.records.evaluation import EvalView
from podrl.controller.records.recorder import RunStore, stored_evaluations
from podrl.controller.service.status import (
    LatestEpisodeView,
    RunState,
    RunStatusView,
    StepView,
    WorkerView,
)

log = logging.getLogger(__name__)

#: SQLite integers are signed 64-bit: a larger ``since`` is a client error (422), not a 500.
_SQLITE_INT_MAX = 2**63 - 1


class ReplicasRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: StrictInt = Field(
        ge=1, description="Worker pods wanted: 1 to controller.max_worker_pods."
    )


class ReplicasView(BaseModel):
    desired_replicas: int | None = Field(description="Worker pods asked for.")
    max_replicas: int = Field(description="The most that may be asked for (max_worker_pods).")


#: Declares the bearer scheme in the OpenAPI document. The token itself is checked by the route
#: class (:func:`credentials_first_route`), before the body is read; this dependency only
#: documents it.
_BEARER = HTTPBearer(auto_error=False, description="`<role>.<worker id>.<mac>`: podrl scale")

#: Methods that read: open to everyone. Every other method changes the run and is checked.
READ_METHODS = frozenset({"GET", "HEAD"})


def _refuse(request: Request, status: int, message: str) -> HTTPException:
    client = request.client
    peer = f"{client.host}:{client.port}" if client else "unknown peer"
    log.warning("refused %s %s from %s: %s", request.method, request.url.path, peer, message)
    headers = {"WWW-Authenticate": 'Bearer realm="podrl"'} if status == 401 else None
    return HTTPException(status, message, headers=headers)


def change_guard(
    secret: RunSecret | None, auth_disabled: bool
) -> Callable[[Request], Caller | None]:
    """The check of every route that changes the run: the verified caller (None when
    ``auth_disabled``), else raises 401/403 with a JSON ``detail`` saying what is missing. It
    reads the request's headers only, never its body."""

    def guard(request: Request) -> Caller | None:
        if auth_disabled:
            return None
        fix = (
            "send Authorization: Bearer <token>, a token of role operator signed with the "
            "run secret (podrl scale makes it from PODRL_RUN_SECRET_FILE, PODRL_RUN_SECRET or "
            "the run dir's run-secret; docs/security.md)"
        )
        scheme, token = get_authorization_scheme_param(request.headers.get("Authorization"))
        if scheme.lower() != "bearer" or not token:
            raise _refuse(request, 401, f"this call changes the run: it needs credentials; {fix}")
        if secret is None:  # built without the secret and not told auth is off: refuse all
            raise _refuse(request, 401, "this controller holds no run secret; no change accepted")
        caller = secret.verify_rest_token(token)
        if isinstance(caller, str):
            raise _refuse(request, 401, f"{caller}; {fix}")
        if caller.role not in REST_CHANGE_ROLES:
            raise _refuse(
                request,
                403,
                f"role {caller.role} ({caller.worker_id}) may not change the run; only "
                f"{' or '.join(sorted(REST_CHANGE_ROLES))} may",
            )
        return caller

    return guard


def credentials_first_route(guard: Callable[[Request], Caller | None]) -> type[APIRoute]:
    """A route class that runs ``guard`` on every route whose methods are not all reads, before
    FastAPI's handler reads the body, parses it or solves any dependency (a dependency would
    run only after the body was parsed: a caller without credentials would get a 422 that
    describes a valid body). The verified caller is left in ``request.state.caller``."""

    class CredentialsFirstRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()
            if self.methods <= READ_METHODS:
                return handler

            async def checked(request: Request) -> Response:
                request.state.caller = guard(request)
                return await handler(request)

            return checked

    return CredentialsFirstRoute


def verified_caller(
    request: Request,
    _bearer: HTTPAuthorizationCredentials | None = Depends(_BEARER),  # noqa: B008
) -> Caller | None:
    """The caller :func:`credentials_first_route` verified (None when auth is disabled)."""
    return request.state.caller


def _json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by its JSON5 name ("NaN",
    "Infinity", "-Infinity"): Python's JSON parser accepts those literals in a body, and a
    validation error that echoes one back cannot be encoded as strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's 422 for a request that does not validate, encodable whatever the input held
    (its own handler raises on a NaN in the echoed input: a 500 and a traceback instead of a
    422)."""
    assert isinstance(exc, RequestValidationError)
    return JSONResponse({"detail": _json_safe(jsonable_encoder(exc.errors()))}, status_code=422)


def build_rest_app(
    state: RunState,
    store: RunStore | None = None,
    scaler: ReplicaScaler | None = None,
    max_replicas: int = 1,
    *,
    secret: RunSecret | None = None,
    auth_disabled: bool = False,
) -> FastAPI:
    """``scaler`` sets the desired pod count (``PUT /v1/workers/replicas``), up to
    ``max_replicas`` (``controller.max_worker_pods``). Changes need a bearer token signed with
    ``secret``; ``auth_disabled`` (``auth.disabled``) lets anyone change. Without either no
    change is accepted: a forgotten secret fails closed."""

    app = FastAPI(
        title="podrl controller",
        version=podrl.__version__,
        description="Status of a podrl run: probes, run status, workers and metrics.",
    )

    # Before any route is added: every route is made with this class.
    app.router.route_class = credentials_first_route(change_guard(secret, auth_disabled))
    app.add_exception_handler(RequestValidationError, _validation_error)
    dashboard_html = (Path(__file__).parent / "dashboard.html").read_text()

    @app.get("/", include_in_schema=False)
    def root() -> RedirectResponse:
        return RedirectResponse("dashboard")

    @app.get("/dashboard", response_class=HTMLResponse, summary="Live dashboard of the run.")
    def dashboard() -> str:
        return dashboard_html

    @app.get("/healthz", summary="Liveness: the controller process is up.")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        summary="Readiness: enough complete, healthy worker pods are registered.",
        responses={503: {"description": "Not ready; the body says what is missing."}},
    )
    def readyz() -> JSONResponse:
        view = state.view()
        body = {
            "ready": view.ready,
            "healthy_pods": view.healthy_pods,
            "min_worker_pods": state.min_worker_pods,
        }
        return JSONResponse(body, status_code=200 if view.ready else 503)

    @app.get("/v1/status", response_model=RunStatusView, summary="The run's status.")
    def status() -> RunStatusView:
        return state.view()

    @app.get(
        "/v1/episodes/latest",
        response_model=LatestEpisodeView | None,
        summary="The latest episode that ended, turn by turn.",
        description="Its prompt, each turn's sampled text (trained) and the environment's "
        "reply (not trained), the reward or the environment's error. The texts are cut to "
        "controller.episode_view_chars in all and their control characters escaped. null "
        "before an episode ended, and in a run whose tasks name no environment.",
    )
    def latest_episode() -> LatestEpisodeView | None:
        return state.latest_episode()

    @app.get("/v1/workers", response_model=list[WorkerView], summary="Registered processes.")
    def workers() -> list[WorkerView]:
        return state.view().workers

    @app.get(
        "/v1/steps",
        response_model=list[StepView],
        summary="Step history, one page: the first `limit` steps after `since`, in order.",
        description="A run with more steps than `limit` is read page by page: ask again with "
        "`since` = the last step received until a page comes back shorter than `limit`. "
        "A figure that was not measured is null.",
    )
    def steps(
        since: int = Query(0, ge=0, le=_SQLITE_INT_MAX, description="Only steps after this one."),
        limit: int = Query(1000, ge=1, le=100_000, description="At most this many steps."),
    ) -> list[StepView]:
        if store is None:
            return []
        return [
            StepView.of(r.step, r.policy_version, r.finished_at, r.metrics)
            for r in store.steps(since=since, limit=limit)
        ]

    def replicas_view() -> ReplicasView:
        desired = scaler.desired_replicas() if scaler is not None else None
        return ReplicasView(desired_replicas=desired, max_replicas=max_replicas)

    @app.get(
        "/v1/workers/replicas",
        response_model=ReplicasView,
        summary="The desired number of worker pods.",
    )
    def get_replicas() -> ReplicasView:
        try:
            return replicas_view()
        except ScaleError as err:
            raise HTTPException(_scale_error_status(err), str(err)) from err

    @app.put(
        "/v1/workers/replicas",
        status_code=202,
        response_model=ReplicasView,
        summary="Set the desired number of worker pods (accepted; pods start or drain after).",
        description="In a cluster the controller patches the worker StatefulSet's `scale` "
        "subresource (as `kubectl scale` does); locally `podrl up`/`podrl run` start or drain "
        "pod processes to match. New pods join at a step boundary; removed pods drain (their "
        "share of a step in flight is done by the others). 422 when `replicas` is not an "
        f"integer from 1 to {max_replicas}.",
        responses={
            401: {"description": "No bearer token, or one not signed with the run secret."},
            403: {"description": "The token's role may not scale (only operator, controller)."},
            422: {"description": "replicas missing, not an integer, or out of range."},
            501: {"description": "This controller cannot scale (no scaler configured)."},
            502: {"description": "The Kubernetes API refused the scale call (the body says why)."},
            503: {"description": "The Kubernetes API server could not be reached."},
        },
    )
    def put_replicas(
        body: ReplicasRequest,
        caller: Caller | None = Depends(verified_caller),  # noqa: B008
    ) -> ReplicasView:
        if body.replicas > max_replicas:  # the same 422 as the model's own checks
            raise HTTPException(
                422,
                [
                    {
                        "type": "less_than_equal",
                        "loc": ["body", "replicas"],
                        "msg": f"Input should be less than or equal to {max_replicas} "
                        "(controller.max_worker_pods)",
                        "input": body.replicas,
                    }
                ],
            )
        if scaler is None:
            raise HTTPException(501, "this controller has no scaler")
        try:
            scaler.set_replicas(body.replicas)
        except ScaleError as err:
            raise HTTPException(_scale_error_status(err), str(err)) from err
        by = "auth disabled" if caller is None else f"{caller.role} {caller.worker_id}"
        log.info("desired worker pods set to %d (REST, %s)", body.replicas, by)
        return ReplicasView(desired_replicas=body.replicas, max_replicas=max_replicas)

    @app.get(
        "/v1/evals",
        response_model=list[EvalView],
        summary="Held-out evaluations of the run, in order (step 0 = before the first step).",
        description="accuracy: share of validly scored evaluation prompts whose greedy "
        "completion reached the task's pass_threshold; reward_mean: their mean reward; both "
        "null when not measured (the evaluation failed: see error).",
    )
    def evals() -> list[EvalView]:
        if store is None:
            return []
        return [EvalView(**e) for e in stored_evaluations(store)]

    @app.get("/metrics", summary="Prometheus metrics (text exposition format).")
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def _scale_error_status(err: ScaleError) -> int:
    """502 when the API server answered with an error, 503 when it could not be reached."""
    return 503 if err.http_status is None else 502
