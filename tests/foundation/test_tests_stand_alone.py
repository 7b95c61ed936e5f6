"""Test modules stand alone: none imports another ``test_*`` module (its helpers, fixtures or
constants). Shared fakes, clusters and checks live in tests/harness/ or in a helper module of
the test's folder, and shared fixtures in the folder's conftest.py, so that a test module can be
run, moved or deleted on its own. The imports are read from the source (``ast``), at any depth
(module level and inside functions)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _is_test_module(dotted: str) -> bool:
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def _resolve(module: Path, root: Path, node: ast.ImportFrom) -> str:
    """The dotted module a ``from ... import`` names, relative imports made absolute."""
    if not node.level:
        return node.module or ""
    package = list(module.relative_to(root.parent).with_suffix("").parts)[: -node.level]
    return ".".join([*package, *([node.module] if node.module else [])])


def imported_test_modules(module: Path, root: Path = TESTS) -> list[str]:
    """The ``test_*`` modules that ``module`` imports (``import``, ``from``, relative)."""
    found = []
    for node in ast.walk(ast.parse(module.read_text(), str(module))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, root, node)
            if _is_test_module(source):
                found.append(source)
            else:  # ``from tests.controller import test_x``
                found += [
                    f"{source}.{alias.name}" for alias in node.names if _is_test_module(alias.name)
                ]
    return found


def cross_imports(root: Path = TESTS) -> list[str]:
    """``importer -> imported`` for every test module under ``root`` importing another."""
    return [
        f"{path.relative_to(root.parent)} imports {imported}"
        for path in sorted(root.rglob("test_*.py"))
        for imported in imported_test_modules(path, root)
    ]


def test_no_test_module_imports_another() -> None:
    assert cross_imports() == [], (
        "move what is shared into tests/harness/ or a helper module of the folder (fixtures "
        "into its conftest.py) and import it from there"
    )


def test_the_check_names_both_modules_of_each_form_of_import(tmp_path: Path) -> None:
    root = tmp_path / "tests"
    (root / "area").mkdir(parents=True)
    (root / "area" / "helpers.py").write_text("from tests.area.test_a import X\n")
    (root / "area" / "test_a.py").write_text("X = 1\n")
    (root / "area" / "test_b.py").write_text(
        "import tests.area.test_a\n"
        "from tests.area.helpers import X\n"
        "def test_x():\n"
        "    from tests.area import test_a\n"
        "    from .test_a import X\n"
    )
    assert cross_imports(root) == [
        "tests/area/test_b.py imports tests.area.test_a",
        "tests/area/test_b.py imports tests.area.test_a",
        "tests/area/test_b.py imports tests.area.test_a",
    ]
