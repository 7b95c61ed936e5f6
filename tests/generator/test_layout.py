"""The generator's layout is what docs/generator.md's module table says: a merged, moved or new
module of ``podrl.generator`` changes the table with it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "services" / "podrl" / "generator"


def test_the_docs_table_names_every_generator_module_and_no_other() -> None:
    text = (ROOT / "docs" / "generator.md").read_text()
    section = text[text.index("## Modules") : text.index("\n## ", text.index("## Modules") + 1)]
    named = {
        name
        for row in section.splitlines()
        if row.startswith("| `generator/")
        for name in re.findall(r"`generator/(\w+\.py)`", row.split("|")[1])
    }
    on_disk = {
        path.name
        for path in GENERATOR.glob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    assert named == on_disk
