"""Render the controller's /v1/status as rich tables.

Text that comes from workers and tasks (worker ids, addresses, states, errors, the run name) is
escaped: rich reads ``[...]`` in a cell as markup, and a stray ``[/]`` would even stop the
command with a MarkupError.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def render_status(status: dict[str, Any], console: Console) -> None:
    run = Table(title=f"podrl run {escape(str(status['run_name']))}", show_header=False)
    run.add_column("field", style="bold")
    run.add_column("value")
    run.add_row("phase", escape(str(status["phase"])))
    run.add_row("ready", "yes" if status["ready"] else "no")
    total = status.get("steps_total")
    run.add_row("step", f"{status['step']} / {total}" if total else str(status["step"]))
    run.add_row("policy version", str(status["policy_version"]))
    run.add_row("healthy pods", escape(", ".join(map(str, status["healthy_pods"]))) or "-")
    desired = status.get("desired_replicas")
    run.add_row("desired pods", "-" if desired is None else escape(str(desired)))
    run.add_row("epoch", escape(str(status.get("epoch", 0))))
    run.add_row("uptime", f"{status['uptime_seconds']:.0f} s")
    metrics = status.get("last_step_metrics", {})
    for name in (
        "reward_mean", "loss", "kl", "entropy", "grad_norm", "logprob_diff_max", "mismatch_kl",
        "update_ratio", "behaviour_age_max",
    ):  # fmt: skip
        if isinstance(metrics.get(name), int | float):
            run.add_row(name, f"{metrics[name]:.4g}")
    warnings = status.get("warnings") or []
    if warnings:  # the latest one names the knob to turn (docs/algorithms.md, "When RL drifts")
        latest = escape(str(warnings[-1].get("message")))
        run.add_row("drift warnings", f"{len(warnings)}; latest: [yellow]{latest}[/]")
    evaluation = status.get("last_eval")
    if evaluation:
        run.add_row("held-out eval", escape(describe_eval(evaluation)))  # may quote workers
    if status.get("error"):
        run.add_row("error", f"[red]{escape(str(status['error']))}[/]")
    for phase, seconds in status.get("phase_seconds", {}).items():
        run.add_row(f"last {escape(str(phase))}", f"{seconds:.2f} s")
    console.print(run)

    if status.get("pods"):
        pods = Table(title="pods")
        for column in ("pod", "state", "policy version", "prompts", "train sequences"):
            pods.add_column(column)
        for pod in status["pods"]:  # worker-supplied text: escaped, never markup
            version = pod.get("policy_version")
            pods.add_row(
                escape(str(pod["id"])),
                escape(str(pod["state"])),
                "-" if version is None else escape(str(version)),
                escape(str(pod.get("share", 0))),
                escape(str(pod.get("train_sequences", 0))),
            )
        console.print(pods)

    workers = Table(title="workers")
    for column in ("worker", "component", "address", "state", "healthy", "last heartbeat"):
        workers.add_column(column)
    for w in status["workers"]:
        workers.add_row(
            *(escape(str(w[key])) for key in ("worker_id", "component", "address", "state")),
            "[green]yes[/]" if w["healthy"] else "[red]no[/]",
            f"{w['seconds_since_heartbeat']:.1f} s ago",
        )
    console.print(workers)


def describe_eval(evaluation: dict[str, Any]) -> str:
    """One evaluation in a line: accuracy, mean reward, after which step (or its error)."""
    where = f"after step {evaluation['step']}" if evaluation["step"] else "before the first step"
    if evaluation.get("accuracy") is None:
        return f"failed {where}: {evaluation.get('error') or 'no prompt was scored'}"
    reward = evaluation.get("reward_mean")
    return (
        f"accuracy {evaluation['accuracy']:.3f}, mean reward "
        f"{'-' if reward is None else f'{reward:.3f}'} on {evaluation['prompts']} prompts "
        f"({where}, policy version {evaluation['policy_version']})"
    )
