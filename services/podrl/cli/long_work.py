"""The CLI's long local jobs with progress bars: ``podrl warm-start`` and ``podrl export``.

Both run in the CLI process with trainer code (torch is imported only here, late).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from podrl.config import RunConfig


def _bar(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def run_warm_start(
    config: RunConfig, base: Path, out: Path, steps: int, lr: float, console: Console
) -> None:
    """``podrl warm-start``: the supervised steps with a progress bar, then the loss table."""
    from podrl.models.tiny import make_tiny_model
    from podrl.trainer.warm_start import warm_start

    if not (base / "config.json").is_file():
        make_tiny_model(base)
    with _bar(console) as progress:
        bar = progress.add_task("warm-start", total=steps, detail="loss -")

        def on_step(step: int, loss: float) -> None:
            progress.update(bar, completed=step, detail=f"loss {loss:.3f}")

        result = warm_start(config, base, out, steps=steps, lr=lr, on_step=on_step)
    table = Table(title=f"supervised warm-start ({steps} steps on task targets)")
    table.add_column("step")
    table.add_column("loss")
    for step in sorted({0, len(result.losses) // 2, len(result.losses) - 1}):
        table.add_row(str(step + 1), f"{result.losses[step]:.3f}")
    console.print(table)
    console.print(f"warm-started model: {out}")


_STAGES = {
    "model": "building the model",
    "checkpoint": "reading the checkpoint",
    "write": "writing",
}


def find_checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of trainer step ``step`` under ``<run_dir>/checkpoints`` (default: the
    newest); ValueError naming what exists otherwise."""
    from podrl.controller.records.checkpoint_files import newest_checkpoint

    folder = run_dir / "checkpoints"
    if step is None:
        newest = newest_checkpoint(folder)
        if newest is None:
            raise ValueError(f"no complete checkpoint under {folder}; is {run_dir} a run folder?")
        return newest
    wanted = folder / f"step-{step:08d}"
    if not wanted.is_dir():
        found = sorted(p.name for p in folder.glob("step-*")) if folder.is_dir() else []
        raise ValueError(f"--step {step}: no {wanted}; checkpoints there: {found or 'none'}")
    return wanted


def cmd_export(args: argparse.Namespace, console: Console) -> int:
    """``podrl export RUN_DIR [--step N] OUT``: a checkpoint as a Hugging Face folder."""
    from podrl.trainer.export import ExportError, export_checkpoint, foreign_entries

    try:
        checkpoint = (
            Path(args.checkpoint)
            if args.checkpoint
            else find_checkpoint(Path(args.run_dir), args.step)
        )
    except ValueError as err:
        print(f"podrl export: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        print(f"podrl export: {out} is a file; name a folder to export into", file=sys.stderr)
        return 2
    present = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if present and not args.overwrite:
        # Checked before the model is loaded: nothing is written into a folder in use.
        shown = ", ".join(present[:5]) + (", ..." if len(present) > 5 else "")
        print(
            f"podrl export: {out} is not empty ({shown}); export into a new or empty folder, or "
            "pass --overwrite (which replaces only the files the export writes and deletes none "
            "it did not write)",
            file=sys.stderr,
        )
        return 2
    with _bar(console) as progress:
        bar = progress.add_task("export", total=len(_STAGES), detail="")

        def on_stage(stage: str) -> None:
            done = list(_STAGES).index(stage)
            progress.update(bar, completed=done, detail=_STAGES[stage])

        try:
            files = export_checkpoint(
                checkpoint,
                out,
                Path(args.model) if args.model else None,
                on_stage,
                overwrite=args.overwrite,
            )
        except ExportError as err:
            progress.stop()
            print(f"podrl export: {err}", file=sys.stderr)
            return 2
        progress.update(bar, completed=len(_STAGES), detail="done")
    console.print(f"exported {checkpoint} to {out}: {', '.join(files)}")
    kept = foreign_entries(out)
    if kept:
        # A loader that globs *.safetensors would read a foreign weights file with the export's.
        console.print(
            f"[yellow]kept files the export did not write in {escape(str(out))}: "
            f"{escape(', '.join(kept))}"
        )
    return 0


def add_export_parser(commands: argparse._SubParsersAction, console: Console) -> None:
    export = commands.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face folder (offline, no services needed)",
    )
    export.add_argument("run_dir", help="the run folder (its checkpoints/ is searched)")
    export.add_argument("out", help="output folder (safetensors, config, tokenizer, ...)")
    export.add_argument(
        "--step",
        type=int,
        help="the checkpoint of this trainer step (folder checkpoints/step-<8 digits>); "
        "default: the newest",
    )
    export.add_argument("--checkpoint", help="a checkpoint folder elsewhere (instead of --step)")
    export.add_argument(
        "--model", help="the model folder the run started from (default: from the checkpoint)"
    )
    export.add_argument(
        "--overwrite",
        action="store_true",
        help="export into a folder that is not empty: the files the export writes are "
        "replaced, every other file is kept (none is deleted)",
    )
    export.set_defaults(func=lambda args: cmd_export(args, console))
