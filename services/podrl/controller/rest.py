"""REST API of the controller (FastAPI): probes, status, workers, Prometheus metrics."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Query, Response
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import podrl
from podrl.controller.run_store import RunStore
from podrl.controller.status import RunState, RunStatusView, StepView, WorkerView

#: SQLite integers are signed 64-bit: a larger ``since`` is a client error (422), not a 500.
_SQLITE_INT_MAX = 2**63 - 1


def build_rest_app(state: RunState, store: RunStore | None = None) -> FastAPI:
    app = FastAPI(
        title="podrl controller",
        version=podrl.__version__,
        description="Status of a podrl run: probes, run status, workers and metrics.",
    )

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
        return [StepView(**vars(r)) for r in store.steps(since=since, limit=limit)]

    @app.get("/metrics", summary="Prometheus metrics (text exposition format).")
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
