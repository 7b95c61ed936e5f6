"""`podrl run`: follow the controller's loop with a progress bar, then summarise the run."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from podrl.cli.eval_report import EvalProgress, eval_table, reward_curve_text
from podrl.cli.local_cluster import LocalCluster
from podrl.cli.reward_plot import plot_reward_curve
from podrl.config import RunConfig

END_PHASES = ("finished", "failed")


def _status(cluster: LocalCluster) -> dict[str, Any] | None:
    try:
        return cluster.http.get(f"{cluster.rest_url}/v1/status", timeout=5).json()
    except httpx.HTTPError:
        return None


def fetch_all_steps(rest_url: str, page: int = 1000) -> list[dict[str, Any]]:
    """Every step of the run from ``/v1/steps``, page by page (one page holds ``page`` steps)."""
    steps: list[dict[str, Any]] = []
    while True:
        since = steps[-1]["step"] if steps else 0
        batch = httpx.get(
            f"{rest_url}/v1/steps", params={"since": since, "limit": page}, timeout=10
        ).json()
        steps.extend(batch)
        if len(batch) < page:
            return steps


def follow_run(
    cluster: LocalCluster, config: RunConfig, stop: threading.Event, console: Console
) -> int:
    """Show step, reward and ETA until the loop ends; print the summary, write the PNG."""
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
        TextColumn("reward {task.fields[reward]}"),
        TextColumn("{task.fields[phase]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
    )
    status: dict[str, Any] | None = None
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task(config.name, total=config.loop.steps, reward="-", phase="")
        evals = EvalProgress(progress, config.loop)
        while not stop.wait(1.0):
            cluster.supervise()  # follows podrl scale, restarts a dead pod process
            status = _status(cluster) or status
            if status is None:
                continue
            reward = status["last_step_metrics"].get("reward_mean")
            progress.update(
                bar,
                completed=status["step"],
                reward="-" if reward is None else f"{reward:.3f}",
                phase=status["phase"],
            )
            evals.update(status)
            if status["phase"] in END_PHASES:
                break
    if status is None or status["phase"] not in END_PHASES:
        console.print("interrupted: the controller checkpoints before it stops")
        return 0
    steps = fetch_all_steps(cluster.rest_url)
    # A step whose reward is unknown (recovered after a crash) is a gap in the curve, not a 0.
    measured = [s for s in steps if s["metrics"].get("reward_mean") is not None]
    summary_path = config.run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    png = plot_reward_curve(measured, config.run_dir / "reward_curve.png", f"podrl {config.name}")
    table = Table(title=f"run {config.name}: {status['phase']}", show_header=False)
    for key in (
        "steps", "steps_trained", "policy_version", "initial_reward_mean", "final_reward_mean",
        "reward_gain", "score_errors", "dropped_samples", "tokens_generated", "wall_seconds",
    ):  # fmt: skip
        value = summary.get(key)
        table.add_row(key, f"{value:.3f}" if isinstance(value, float) else str(value))
    table.add_row("reward curve", str(png) if png else "no PNG: matplotlib is not installed")
    table.add_row("samples", str(config.run_dir / "samples.jsonl"))
    export = summary.get("export") or {}
    table.add_row("trained model", str(export.get("path") or export.get("error") or "-"))
    table.add_row("tensorboard", str(summary.get("tensorboard_dir") or "-"))
    console.print(table)
    if summary.get("evaluations"):
        console.print(eval_table(summary["evaluations"]))
    console.print(reward_curve_text(measured), markup=False)
    if status["phase"] == "failed":
        console.print(f"[red]run failed: {escape(str(status.get('error')))}[/]")  # worker text
        return 1
    return 0
