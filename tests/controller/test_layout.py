"""The controller's layout is what docs/controller.md says, and its entry points resolve."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTROLLER = ROOT / "services" / "podrl" / "controller"


def _documented_files() -> set[str]:
    text = (ROOT / "docs" / "controller.md").read_text()
    section = text[text.index("## The code") : text.index("## One step")]
    files: set[str] = set()
    for row in section.splitlines():
        if row.startswith("| `"):
            first_cell = row.split("|")[1]
            files |= set(re.findall(r"`([\w/]+\.(?:py|html))`", first_cell))
    return files


def test_the_docs_table_names_every_controller_file_and_no_other() -> None:
    on_disk = {
        str(path.relative_to(CONTROLLER))
        for path in CONTROLLER.rglob("*")
        if path.suffix in (".py", ".html") and path.name not in ("__init__.py", "__main__.py")
    }
    assert _documented_files() == on_disk


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at load time or lazily."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_the_loop_knows_no_mode_and_the_modes_do_not_know_the_loop() -> None:
    drivers = {"podrl.controller.step.sync_steps", "podrl.controller.step.async_steps"}
    assert not _imports(CONTROLLER / "step" / "loop.py") & drivers
    for driver in ("sync_steps.py", "async_steps.py", "parts.py"):
        assert "podrl.controller.step.loop" not in _imports(CONTROLLER / "step" / driver)


def test_the_controllers_entry_points_resolve() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["podrl-controller"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    # ``python -m podrl.controller`` (the local launcher) runs the same main.
    main_module = ast.parse((CONTROLLER / "__main__.py").read_text())
    assert any(
        isinstance(node, ast.ImportFrom) and node.module == module for node in main_module.body
    )
