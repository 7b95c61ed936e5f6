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


def _names_in_class(path: Path, class_name: str) -> set[str]:
    """Every name and attribute ``class_name``'s body in ``path`` uses."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    names = {n.id for n in ast.walk(cls) if isinstance(n, ast.Name)}
    return names | {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)}


def test_the_loop_knows_no_mode_and_the_modes_do_not_know_the_loop() -> None:
    loop = CONTROLLER / "step" / "loop.py"
    assert "podrl.controller.step.async_steps" not in _imports(loop)
    assert not _names_in_class(loop, "GrpoLoop") & {"SyncSteps", "AsyncSteps"}
    async_steps = CONTROLLER / "step" / "async_steps.py"
    for path, driver in ((loop, "SyncSteps"), (async_steps, "AsyncSteps")):
        assert "GrpoLoop" not in _names_in_class(path, driver)


def test_the_controllers_entry_points_resolve() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["podrl-controller"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    # ``python -m podrl.controller`` (the local launcher) runs the same main.
    main_module = ast.parse((CONTROLLER / "__main__.py").read_text())
    assert any(
        isinstance(node, ast.ImportFrom) and node.module == module for node in main_module.body
    )
