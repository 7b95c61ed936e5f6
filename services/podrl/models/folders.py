"""Model folders: the configured one, or the project's tiny model written once, atomically.

The trainer and the generator of a pod both resolve `<run_dir>/models/tiny` when no model is
configured and may start together: whichever comes first writes it, the other uses it.

Nothing is written unless the caller allows the tiny model (``create_tiny_model_if_missing``),
and the generator allows it only where the config asks for it (:func:`may_write_tiny_model`): a
configured model folder that is missing is an error, never a random model written in its place
(which the next run would have trained, silently). ``podrl up`` checks the configured folders
before it starts anything (:func:`check_model_folders`).
A folder that cannot be read or written (a read-only mount, a read-only root filesystem, no
permission) is a ModelFolderError naming the config field, never a bare OSError: on Kubernetes
a bare OSError is a crash with a traceback, a ConfigError is exit code 2 with the fix.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Protocol

from podrl.config import ConfigError, RunConfig

log = logging.getLogger(__name__)


class ModelFolderError(ConfigError):
    """The model folder is missing or unusable; the message names the config field to fix
    (a ConfigError, so the service exits with code 2 and the message)."""


def _has_model(path: Path, field: str) -> bool:
    try:
        return (path / "config.json").is_file()
    except OSError as err:  # e.g. EACCES on a folder of another user
        raise ModelFolderError(
            f"{field}: cannot read {path}: {err.strerror}; make the folder readable by the "
            "service's user or point the field at another model folder"
        ) from None


def ensure_model_folder(
    path: Path, create_tiny_model_if_missing: bool, field: str = "generator.model_path"
) -> Path:
    """Return ``path`` once it holds a model; write the tiny Qwen3 there first if allowed.

    The tiny model is written into a temporary sibling folder and renamed into place, so a
    trainer and a generator starting together never read a half-written folder (the loser of
    the rename race uses the winner's identical files). Raises ModelFolderError (naming
    ``field``) when the folder has no model and may not, or cannot, be written.
    """
    if _has_model(path, field):
        return path
    if not create_tiny_model_if_missing:
        raise ModelFolderError(
            f"{field}: {path} has no config.json; point it at a Hugging Face model folder "
            "(`podrl make-tiny-model DIR` writes a small one)"
        )
    from podrl.models.tiny import make_tiny_model  # torch + transformers: import late

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    except OSError as err:
        raise ModelFolderError(
            f"{field}: {path} has no model and the tiny model cannot be written there "
            f"({err.strerror}: {err.filename}); point {field} at a folder that holds a model "
            "(a read-only mount is fine), or at a writable folder for the tiny model"
        ) from None
    try:
        make_tiny_model(staging)
        try:
            os.rename(staging, path)
            log.info("wrote the tiny model to %s", path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    except OSError as err:
        raise ModelFolderError(
            f"{field}: writing the tiny model to {path} failed ({err.strerror}: "
            f"{err.filename}); free space or fix the folder's permissions"
        ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


class _GeneratorModel(Protocol):
    model_path: Path | None
    create_tiny_model_if_missing: bool
    model_fields_set: set[str]


def may_write_tiny_model(generator: _GeneratorModel) -> bool:
    """Whether the generator may write the tiny model where its model folder is missing: only
    for the default folder (no ``model_path`` configured, the trainer's default too), or when
    ``create_tiny_model_if_missing: true`` is set explicitly; never for a configured folder by
    the field's default."""
    if not generator.create_tiny_model_if_missing:
        return False
    return (
        generator.model_path is None or "create_tiny_model_if_missing" in generator.model_fields_set
    )


def check_model_folders(config: RunConfig) -> None:
    """Raise ModelFolderError naming the field when a configured model folder of the trainer
    or the generator holds no model and nothing may write one there (reads only)."""
    trainer_path = config.trainer.model_path
    if trainer_path is not None and not _has_model(Path(trainer_path), "trainer.model_path"):
        raise ModelFolderError(
            f"trainer.model_path: {trainer_path} has no config.json; point it at a Hugging "
            "Face model folder (`podrl make-tiny-model DIR` writes a small one)"
        )
    generator = config.generator
    if generator.model_path is None or may_write_tiny_model(generator):
        return
    if not _has_model(generator.model_path, "generator.model_path"):
        raise ModelFolderError(
            f"generator.model_path: {generator.model_path} has no config.json; point it at a "
            "Hugging Face model folder (`podrl make-tiny-model DIR` writes a small one), or "
            "set generator.create_tiny_model_if_missing: true to have a random tiny model "
            "written there"
        )


def default_model_folder(run_dir: Path) -> Path:
    """Where the tiny model lives when no model is configured."""
    return Path(run_dir) / "models" / "tiny"
