"""The module table of a package's docs page ("## The code") names every module of the package
and no other, so a merged, moved or new file cannot leave the page behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "podrl"
PAGES = {"tasks": "tasks.md", "grader": "grader.md", "environments": "environments.md"}


def documented(page: str) -> set[str]:
    """The paths in the first cell of the rows of the page's "## The code" table."""
    text = (ROOT / "docs" / page).read_text()
    start = text.index("## The code\n")
    section = text[start : text.index("\n## ", start + 1)]
    return {
        path
        for row in section.splitlines()
        if row.startswith("| `")
        for path in re.findall(r"`([\w/]+\.py)`", row.split("|")[1])
    }


@pytest.mark.parametrize("package", sorted(PAGES))
def test_the_module_table_names_every_module_of_the_package(package: str) -> None:
    on_disk = {
        path.relative_to(PACKAGE).as_posix()
        for path in (PACKAGE / package).rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    assert documented(PAGES[package]) == on_disk
