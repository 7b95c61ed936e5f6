"""``podrl`` command line: ``up`` (local cluster), ``run``, ``scale``, ``status``, ``warm-start``,
``make-tiny-model``, ``export``."""

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

from podrl.cli.local_cluster import ChildExitedError, LocalCluster, ready_line
from podrl.cli.long_work import add_export_parser
from podrl.cli.probes import grpc_health
from podrl.cli.run_progress import follow_run
from podrl.cli.status_table import render_status
from podrl.common.auth import OPERATOR, RunSecret, load_run_secret
from podrl.config import ConfigError, RunConfig, load_config
from podrl.config.auth import SECRET_FILE_ENV, SECRET_VALUE_ENV, AuthConfig
from podrl.tasks.prompt_bounds import check_prompts_fit

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
    expected = 3 * len(cluster.pods)  # a generator, a grader and a trainer per pod
    record(
        "controller /v1/status",
        body["ready"] and len(healthy) == expected,
        f"{len(healthy)} of {expected} healthy",
    )
    metrics = httpx.get(f"{cluster.rest_url}/metrics", timeout=5).text
    families = list(text_string_to_metric_families(metrics))
    record("controller /metrics", bool(families), f"{len(families)} metric families")
    console.print(table)
    return ok


def _load(args: argparse.Namespace, command: str, *, runs_loop: bool = False) -> RunConfig | None:
    """The run config of ``--config``, or None after printing why. ``runs_loop``: the command
    starts a controller that runs the loop, whose start checks (prompts that fit the model
    length) are run here too, before anything starts."""
    try:
        config = load_config(args.config)
        if runs_loop and config.loop.steps:
            check_prompts_fit(config)
        return config
    except ConfigError as err:
        print(f"podrl {command}: {err}", file=sys.stderr)
        return None


def _run_cluster(
    config: RunConfig,
    config_path: str | None,
    startup_timeout: float,
    body: Callable[[LocalCluster, threading.Event], int],
    pods: int | None = None,
) -> int:
    """Start the local cluster, wait for health, run ``body``; always stop every child."""
    try:
        cluster = LocalCluster(
            config, config_path, pods, on_event=lambda m: console.print(f"podrl: {m}", markup=False)
        )
    except ValueError as err:
        print(f"podrl: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        cluster.start()
        console.print(
            f"starting controller and {cluster.desired_replicas()} worker pod(s) "
            f"(generator, grader, trainer each; logs: {cluster.log_dir})"
        )
        if not cluster.wait_ready(startup_timeout, stop.is_set):
            return 0
        # One line whatever the terminal's width: benches read it from the run's log.
        console.print(f"podrl: {ready_line(cluster.ready_times())}", markup=False, soft_wrap=True)
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
    config = _load(args, "up", runs_loop=True)
    if config is None:
        return 2

    def body(cluster: LocalCluster, stop: threading.Event) -> int:
        if args.self_check:
            return 0 if _self_check(cluster) else 1
        while not stop.wait(0.5):
            cluster.supervise()  # follows podrl scale / PUT /v1/workers/replicas
        console.print("stopping")
        return 0

    return _run_cluster(config, args.config, args.startup_timeout, body, args.pods)


def cmd_run(args: argparse.Namespace) -> int:
    config = _load(args, "run", runs_loop=True)
    if config is None:
        return 2
    if config.loop.steps == 0:
        print("podrl run: loop.steps is 0; set it in the config (e.g. loop: {steps: 50})",
              file=sys.stderr)  # fmt: skip
        return 2

    def body(cluster: LocalCluster, stop: threading.Event) -> int:
        return follow_run(cluster, config, stop, console)

    return _run_cluster(config, args.config, args.startup_timeout, body, args.pods)


#: The worker id ``podrl scale``'s operator token names (it shows in the controller's log).
SCALE_OPERATOR_ID = "podrl-scale"


def _scale_secret(args: argparse.Namespace) -> tuple[RunSecret | None, str]:
    """The run secret ``podrl scale`` signs with, and where it was looked for: the services'
    own variables (``PODRL_RUN_SECRET_FILE`` / ``PODRL_RUN_SECRET``) first, else the
    ``run-secret`` file ``podrl up``/``podrl run`` write into the run dir of ``--config`` (the
    built-in run dir without it). None when neither exists or the config says auth.disabled.
    Raises ConfigError for a secret that is there but unusable (unreadable, short, twice)."""
    if SECRET_FILE_ENV in os.environ or SECRET_VALUE_ENV in os.environ:
        return load_run_secret(AuthConfig(), os.environ), "the environment"
    config = load_config(args.config)
    if config.auth.disabled:
        return None, "none needed: the config says auth.disabled"
    secret_file = config.run_dir / "run-secret"
    if not secret_file.exists():
        return None, f"{SECRET_FILE_ENV}, {SECRET_VALUE_ENV} or {secret_file}"
    return load_run_secret(config.auth, {SECRET_FILE_ENV: str(secret_file)}), str(secret_file)


def cmd_scale(args: argparse.Namespace) -> int:
    """``podrl scale --replicas N``: PUT /v1/workers/replicas on the controller, with an
    operator token signed by the run secret (docs/security.md)."""
    url = f"{args.url.rstrip('/')}/v1/workers/replicas"
    try:
        secret, looked_in = _scale_secret(args)
    except ConfigError as err:
        print(f"podrl scale: {err}", file=sys.stderr)
        return 2
    headers = {}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret.rest_token(OPERATOR, SCALE_OPERATOR_ID)}"
    try:
        reply = httpx.put(
            url, json={"replicas": args.replicas}, headers=headers, timeout=args.timeout
        )
    except httpx.HTTPError as err:
        print(f"podrl scale: cannot reach {url}: {err}", file=sys.stderr)
        return 1
    if reply.status_code != 202:
        try:
            detail = reply.json().get("detail", reply.text)
        except ValueError:
            detail = reply.text
        if isinstance(detail, list):  # FastAPI's validation errors: field and reason
            detail = "; ".join(
                f"{'.'.join(str(x) for x in e.get('loc', [])[1:])}: {e.get('msg')}" for e in detail
            )
        print(f"podrl scale: {reply.status_code}: {detail}", file=sys.stderr)
        if reply.status_code == 401:
            print(
                f"podrl scale: signed with the run secret from {looked_in}"
                if secret is not None
                else f"podrl scale: no run secret found (looked in {looked_in}); set "
                f"{SECRET_FILE_ENV} to the run's secret file, or pass the run's --config",
                file=sys.stderr,
            )
        return 2 if reply.status_code == 422 else 1
    body = reply.json()
    console.print(
        f"desired worker pods: {body['desired_replicas']} (at most {body['max_replicas']}); "
        "new pods join at a step boundary, removed ones drain"
    )
    return 0


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

    from podrl.cli.long_work import run_warm_start  # torch: import late

    config = _load(args, "warm-start")
    if config is None:
        return 2
    base = Path(args.base) if args.base else config.run_dir / "models" / "tiny"
    out = Path(args.out) if args.out else config.run_dir / "models" / "warm"
    run_warm_start(config, base, out, args.steps, args.lr, console)
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
    up.add_argument(
        "--pods",
        type=int,
        help="worker pods to start (default: controller.worker_pods, 1); podrl scale changes it",
    )
    up.set_defaults(func=cmd_up)

    run = commands.add_parser(
        "run", help="run a GRPO job locally (resumes from the run dir's last checkpoint)"
    )
    run.add_argument("config", help="run config YAML with loop.steps > 0")
    run.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for health"
    )
    run.add_argument(
        "--pods",
        type=int,
        help="worker pods to start (default: controller.worker_pods, 1); podrl scale changes it",
    )
    run.set_defaults(func=cmd_run)

    scale = commands.add_parser(
        "scale", help="set the number of worker pods of a run (local or in a cluster)"
    )
    scale.add_argument(
        "--replicas", type=int, required=True, help="worker pods wanted (1..max_worker_pods)"
    )
    scale.add_argument(
        "--url",
        default=os.environ.get("PODRL_URL", "http://127.0.0.1:8080"),
        help="controller REST URL (default: $PODRL_URL or http://127.0.0.1:8080)",
    )
    scale.add_argument(
        "--config",
        help="the run's config YAML: its run dir holds the run-secret podrl up/run wrote "
        f"(default: built-in defaults; {SECRET_FILE_ENV} or {SECRET_VALUE_ENV} take precedence)",
    )
    scale.add_argument("--timeout", type=float, default=10.0)
    scale.set_defaults(func=cmd_scale)

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
    add_export_parser(commands, console)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
