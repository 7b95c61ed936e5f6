"""No module of ``services/podrl`` imports itself back, directly or through others.

The graph is built from the source (``ast``), so it holds every import: module level,
function level (lazy) and ``TYPE_CHECKING``-only ones. A lazy or type-only import keeps the
program running, but each cycle is still a two-way dependence a reader has to hold in mind.

Edges: ``import a.b`` and ``from a.b import x`` lead to ``a.b``; ``from a import b`` also leads
to ``a`` itself (the package ``__init__`` that ``b`` is taken from), and to ``a.b`` when that is a
module. Importing ``a.b.c`` runs ``a/__init__`` as well, but that implicit step is not an edge:
a package whose ``__init__`` re-exports its submodules is no cycle by itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "services"
PACKAGE = "podrl"

KNOWN_CYCLES: dict[frozenset[str], str] = {}
"""Cycles in parts being reworked now, each with what removes it. An entry whose cycle is gone
fails the test, so the list only shrinks."""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (see the module docstring)."""
    files = {
        module_name(path, root): path
        for path in (root / package).rglob("*.py")
        if "v1" not in path.relative_to(root / package).parts[:1]
    }
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    base = ".".join([*anchor, base] if base else anchor)
                targets.add(base)
                targets.update(f"{base}.{alias.name}" for alias in node.names)
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One shortest import chain from ``component[0]`` back to itself (breadth first)."""
    start = component[0]
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & set(component)):
                if target == start:
                    chain = [node]
                    while chain[-1] != start:
                        chain.append(parents[chain[-1]])
                    return [*reversed(chain), start]
                if target not in parents:
                    parents[target] = node
                    following.append(target)
        frontier = following
    raise ValueError(f"{component} is not a cycle of the graph")


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The first-level packages (``podrl.trainer``, ``podrl.weights``, ...) and which import
    which."""

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {top(m): set() for m in graph}
    for module, targets in graph.items():
        packages[top(module)].update(top(t) for t in targets if top(t) != top(module))
    return packages


def test_the_graph_sees_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\nA = 1\n"
    )
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import b\nfrom . import d\n")
    (pkg / "sub" / "d.py").write_text("import pkg.sub.c\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg", "pkg.a"}
    assert graph["pkg.sub.c"] == {"pkg", "pkg.b", "pkg.sub", "pkg.sub.d"}
    assert cycles(graph) == [["pkg", "pkg.a", "pkg.b"], ["pkg.sub.c", "pkg.sub.d"]]
    assert shortest_cycle(graph, ["pkg", "pkg.a", "pkg.b"]) == ["pkg", "pkg.a", "pkg.b", "pkg"]


def test_no_module_imports_itself_back() -> None:
    graph = import_graph()
    found = {frozenset(cycle): cycle for cycle in cycles(graph)}
    new = [
        " -> ".join(shortest_cycle(graph, cycle))
        for key, cycle in found.items()
        if key not in KNOWN_CYCLES
    ]
    assert not new, "import cycles: " + "; ".join(new)
    gone = [sorted(key) for key in KNOWN_CYCLES if key not in found]
    assert not gone, f"these cycles are gone: remove them from KNOWN_CYCLES: {gone}"


@pytest.mark.parametrize(("first", "second"), [("podrl.trainer", "podrl.weights")])
def test_packages_depend_one_way(first: str, second: str) -> None:
    packages = package_graph(import_graph())
    both = second in packages[first] and first in packages[second]
    assert not both, f"{first} and {second} import each other"
