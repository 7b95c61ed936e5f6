"""The call recorder behind docs/architecture.md's step and sync lists (tests/harness/walk.py):
what it counts, in a process of a toy package, and how it writes a recording into the docs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.walk import DOC, RECORDER, documented, write_docs

_MODULES = {
    "__init__.py": "",
    "shapes.py": (
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Point:\n    x: int\n    y: int\n"
    ),
    "work.py": (
        "from toy.shapes import Point\n\n\n"
        "def build():\n    return Point(1, 2)\n\n\n"
        "class Marker:\n    def go(self):\n        return [n for n in range(3)]\n"
    ),
    "imported.py": "NUMBERS = [n for n in range(3)]\n\n\nclass Body:\n    SIZE = 2\n",
}
_RUN = (
    "import threading, toy.imported, toy.work\n"
    "t = threading.Thread(target=toy.work.build, name='builder')\n"
    "t.start(); t.join()\n"
    "toy.work.Marker().go()\n"
)


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What the recorder wrote for one process of the toy package."""
    tmp_path = tmp_path_factory.mktemp("recorder")
    package = tmp_path / "src" / "toy"
    package.mkdir(parents=True)
    for name, text in _MODULES.items():
        (package / name).write_text(text)
    site = tmp_path / "site"
    site.mkdir()
    shutil.copy(RECORDER, site / "sitecustomize.py")
    env = {
        **os.environ,
        "PYTHONPATH": f"{site}{os.pathsep}{package.parent}",
        "WALK_RECORDER_DIR": str(tmp_path / "records"),
        "WALK_RECORDER_ROOT": str(package),
        "WALK_RECORDER_MARKERS": "Marker.go",
    }
    subprocess.run([sys.executable, "-c", _RUN], env=env, check=True, timeout=60)
    (record,) = (tmp_path / "records").glob("*.json")
    return json.loads(record.read_text())


def test_building_a_dataclass_counts_its_module_in_the_thread_that_built_it(
    record: dict[str, Any],
) -> None:
    # The generated __init__ has the file name <string>: without the mapping to its class,
    # shapes.py would not be recorded at all.
    spans = record["spans"]
    assert set(spans["shapes.py"]) == {"builder"}
    assert set(spans["work.py"]) == {"builder", "MainThread"}


def test_import_time_code_is_not_counted_and_markers_are_stored(record: dict[str, Any]) -> None:
    # imported.py ran its module body, a comprehension in it and a class body: no function.
    assert "imported.py" not in record["spans"]
    assert [(m[0], m[1], m[3]) for m in record["marks"]] == [
        ("Marker.go", "call", "MainThread"),
        ("Marker.go", "return", "MainThread"),
    ]


def test_write_docs_writes_a_recording_into_the_table_and_the_lists(tmp_path: Path) -> None:
    doc = tmp_path / "architecture.md"
    shutil.copy(DOC, doc)
    before = documented(doc)
    paths = {key: {f: {"t"} for f in files} for key, (_, files) in before.items()}
    for key in ("step_version_only", "step_full_manifest"):
        paths[key]["trainer/extra.py"] = {"t"}
    write_docs(paths, doc)
    after = documented(doc)
    for key, (count, files) in before.items():
        grown = key.startswith("step")
        assert after[key] == (count + grown, files | ({"trainer/extra.py"} if grown else set()))
    # Only the trainer's item of the step's list and the figures changed.
    changed = set(doc.read_text().splitlines()) - set(DOC.read_text().splitlines())
    assert all("|" in line or "trainer" in line or "the " in line for line in changed), changed
