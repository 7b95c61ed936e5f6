"""`podrl status` prints worker and task text as it is (rich reads ``[...]`` as markup)."""

from __future__ import annotations

from typing import Any

from rich.console import Console

from podrl.cli.status_table import render_status

HOSTILE = "[/][bold red]pwned[/bold red] [link=http://x]click[/link]"


def _status(**overrides: Any) -> dict[str, Any]:
    status = {
        "run_name": "run",
        "phase": "train",
        "ready": True,
        "step": 3,
        "steps_total": 10,
        "policy_version": 3,
        "healthy_pods": ["pod-0"],
        "uptime_seconds": 5.0,
        "last_step_metrics": {},
        "error": None,
        "phase_seconds": {},
        "workers": [
            {
                "worker_id": "pod-0",
                "component": "trainer",
                "address": "127.0.0.1:1",
                "state": "serving",
                "healthy": True,
                "seconds_since_heartbeat": 1.0,
            }
        ],
    }
    status.update(overrides)
    return status


def test_worker_and_error_text_is_printed_as_text() -> None:
    """On the old table the leading ``[/]`` raised rich's MarkupError: `podrl status` crashed
    on a run whose error (a worker's message) or worker id held it."""
    worker = {**_status()["workers"][0], "worker_id": HOSTILE, "address": HOSTILE}
    status = _status(error=HOSTILE, run_name=HOSTILE, workers=[worker], healthy_pods=[HOSTILE])
    console = Console(record=True, width=400, color_system=None)
    render_status(status, console)
    text = console.export_text()
    assert text.count(HOSTILE) == 5  # title, healthy pods, error, worker id, address


def test_the_latest_drift_warning_is_printed_with_its_knob() -> None:
    message = "step 3: mismatch_kl 1.9 > 0.02 (loop.drift_warnings.mismatch_kl_max): lower [x]"
    warnings = [{"step": 2, "message": "older"}, {"step": 3, "message": message}]
    metrics = {"mismatch_kl": 1.9, "update_ratio": 2e-5, "behaviour_age_max": 1}
    console = Console(record=True, width=400, color_system=None)
    render_status(_status(warnings=warnings, last_step_metrics=metrics), console)
    text = console.export_text()
    assert f"2; latest: {message}" in text  # "[x]" printed as text, not read as markup
    assert "mismatch_kl" in text and "1.9" in text and "2e-05" in text
