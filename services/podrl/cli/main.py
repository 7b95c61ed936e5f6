"""``podrl`` command line: ``up`` (local cluster), ``status``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from podrl.cli.local_cluster import ChildExitedError, LocalCluster
from podrl.cli.probes import grpc_health
from podrl.cli.run_progress import follow_run
from podrl.cli.status_table import render_status
from podrl.config import ConfigError, RunConfig, load_config

console = Console(stderr=False)


def _self_check(cluster: LocalCluster) -> bool:
    """Probe every service the way Kubernetes and a user would; print a table of results."""
    table = Table(title="self-check")
    table.add_column("check")
    table.add_column("result")
    ok = True

    def record(name: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= passed
        table.add_row(name, f"[green]ok[/] {detail}" if passed else f"[red]FAIL[/] {detail}")

    for child in cluster.children:
        for service in ("", child.grpc_service):
            status = grpc_health(child.grpc_address, service)
            record(f"{child.name} health '{service}'", status == "SERVING", status)
    status = grpc_health(cluster.children[0].grpc_address, "podrl.v1.NoSuchService")
    record("unknown service name", status == "NOT_FOUND", status)
    body = httpx.get(f"{cluster.rest_url}/v1/status", timeout=5).json()
    healthy = [w for w in body["workers"] if w["healthy"]]
    record("controller /v1/status", body["ready"] and len(healthy) == 3, f"{len(healthy)} healthy")
    metrics = httpx.get(f"{cluster.rest_url}/metrics", timeout=5).text
    families = list(text_string_to_metric_families(metrics))
    record("controller /metrics", bool(families), f"{len(families)} metric families")
    console.print(table)
    return ok


def _load(args: argparse.Namespace, command: str) -> RunConfig | None:
    try:
        return load_config(args.config)
    except ConfigError as err:
        print(f"podrl {command}: {err}", file=sys.stderr)
        return None


def _run_cluster(
    config: RunConfig,
    config_path: str | None,
    startup_timeout: float,
    body: Callable[[LocalCluster, threading.Event], int],
) -> int:
    """Start the local cluster, wait for health, run ``body``; always stop every child."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    cluster = LocalCluster(config, config_path)
    try:
        cluster.start()
        console.print(f"starting controller, generator, grader, trainer (logs: {cluster.log_dir})")
        if not cluster.wait_ready(startup_timeout, stop.is_set):
            return 0
        urls = Table(title="podrl is up", show_header=False)
        for name, url in cluster.urls().items():
            urls.add_row(name, url)
        console.print(urls)
        console.print(f"status: podrl status --url {cluster.rest_url}")
        return body(cluster, stop)
    except ChildExitedError as err:
        console.print(f"[red]podrl: {err}[/]; stopping the others")
        tail = err.child.log_tail()
        if tail:
            console.print(f"last lines of {err.child.log_path}:\n{tail}", markup=False)
        return 1
    except TimeoutError as err:
        console.print(f"[red]podrl: {err}[/]")
        return 1
    finally:
        # With a loop configured, the controller stops first: it checkpoints through the trainer.
        grace = config.grpc.shutdown_grace_seconds + 5
        cluster.stop(
            grace + 60 if config.loop.steps else grace, controller_first=bool(config.loop.steps)
        )


def cmd_up(args: argparse.Namespace) -> int:
    config = _load(args, "up")
    if config is None:
        return 2

    def body(cluster: LocalCluster, stop: threading.Event) -> int:
        if args.self_check:
            return 0 if _self_check(cluster) else 1
        while not stop.wait(0.5):
            cluster.check_alive()
        console.print("stopping")
        return 0

    return _run_cluster(config, args.config, args.startup_timeout, body)


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args, "run")
    if config is None:
        return 2
    if config.loop.steps == 0:
        print("podrl run: loop.steps is 0; set it in the config (e.g. loop: {steps: 50})",
              file=sys.stderr)  # fmt: skip
        return 2

    def body(cluster: LocalCluster, stop: threading.Event) -> int:
        return follow_run(cluster, config, stop, console)

    return _run_cluster(config, args.config, args.startup_timeout, body)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        reply = httpx.get(f"{args.url.rstrip('/')}/v1/status", timeout=args.timeout)
        reply.raise_for_status()
    except httpx.HTTPError as err:
        print(f"podrl status: cannot read {args.url}/v1/status: {err}", file=sys.stderr)
        return 1
    render_status(reply.json(), console)
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from podrl.models.tiny import TinyModelSpec, make_tiny_model  # needs torch: import late

    spec = TinyModelSpec(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        seed=args.seed,
    )
    out = make_tiny_model(args.out_dir, spec)
    console.print(f"wrote tiny Qwen3 ({spec.num_layers} layers x {spec.hidden_size}) to {out}")
    return 0


def cmd_warm_start(args: argparse.Namespace) -> int:
    from pathlib import Path

    from podrl.models.tiny import make_tiny_model  # torch: import late
    from podrl.trainer.warm_start import warm_start

    config = _load(args, "warm-start")
    if config is None:
        return 2
    base = Path(args.base) if args.base else config.run_dir / "models" / "tiny"
    if not (base / "config.json").is_file():
        make_tiny_model(base)
    out = Path(args.out) if args.out else config.run_dir / "models" / "warm"
    result = warm_start(config, base, out, steps=args.steps, lr=args.lr)
    table = Table(title=f"supervised warm-start ({args.steps} steps on task targets)")
    table.add_column("step")
    table.add_column("loss")
    for step in sorted({0, len(result.losses) // 2, len(result.losses) - 1}):
        table.add_row(str(step + 1), f"{result.losses[step]:.3f}")
    console.print(table)
    console.print(f"warm-started model: {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="podrl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="run controller, generator, grader and trainer locally")
    up.add_argument("--config", help="run config YAML (default: built-in defaults)")
    up.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for health"
    )
    up.add_argument("--self-check", action="store_true", help="probe every service once, then stop")
    up.set_defaults(func=cmd_up)

    run = commands.add_parser(
        "run", help="run a GRPO job locally (resumes from the run dir's last checkpoint)"
    )
    run.add_argument("config", help="run config YAML with loop.steps > 0")
    run.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for health"
    )
    run.set_defaults(func=cmd_run)

    status = commands.add_parser("status", help="print a controller's run status")
    status.add_argument(
        "--url",
        default=os.environ.get("PODRL_URL", "http://127.0.0.1:8080"),
        help="controller REST URL (default: $PODRL_URL or http://127.0.0.1:8080)",
    )
    status.add_argument("--timeout", type=float, default=5.0)
    status.set_defaults(func=cmd_status)

    warm = commands.add_parser(
        "warm-start", help="short supervised warm-start on the config's tasks (writes a model)"
    )
    warm.add_argument("config", help="run config YAML (its tasks section is used)")
    warm.add_argument("--steps", type=int, default=30)
    warm.add_argument("--lr", type=float, default=5e-4)
    warm.add_argument("--base", help="model folder to start from (default: the tiny model)")
    warm.add_argument("--out", help="output folder (default: <run_dir>/models/warm)")
    warm.set_defaults(func=cmd_warm_start)

    tiny = commands.add_parser(
        "make-tiny-model", help="write a random-init tiny Qwen3 + char tokenizer (HF folder)"
    )
    tiny.add_argument("out_dir")
    tiny.add_argument("--layers", type=int, default=2)
    tiny.add_argument("--hidden", type=int, default=128)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=cmd_make_tiny_model)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
