"""docs/architecture.md's "Reading order": every file it names exists, and each file list holds
as many files as its heading and the table say (a moved, merged or deleted file breaks this)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "services" / "podrl"
PATH = re.compile(r"`([\w/]+\.py)`")
# The like-for-like paragraph spells its count of left-out files as a word.
_NUMBERS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
]


def _section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("## Reading order\n")
    return text[start : text.index("\n## ", start + 1)]


def _details(summary_start: str) -> str:
    section = _section()
    start = section.index(f"<details><summary>{summary_start}")
    return section[start : section.index("</details>", start)]


def _package_lists(block: str) -> dict[str, list[str]]:
    """``- **package (n)**: `file`, ...`` items: package → its files, checked against n."""
    lists = {}
    for item in re.findall(r"^- \*\*(.+?)\*\*: (.+?)(?=^- |^\n|\Z)", block, re.M | re.S):
        heading, body = item
        package, count = re.fullmatch(r"(\w+) \((\d+)\)", heading).groups()
        files = PATH.findall(body)
        assert len(files) == int(count), f"{package}: heading says {count}, lists {len(files)}"
        assert all(f.startswith(f"{package}/") for f in files), (package, files)
        lists[package] = files
    return lists


def _table_row(path: str) -> tuple[int, int]:
    files, packages = re.search(
        rf"^\| {re.escape(path)} \| (\d+) \| (\d+) \|", _section(), re.M
    ).groups()
    return int(files), int(packages)


def test_every_file_the_reading_order_names_exists() -> None:
    named = set(PATH.findall(_section()))
    assert len(named) > 20  # the path regex still finds the lists
    missing = sorted(
        name
        for name in named
        if not (ROOT / name if name.startswith("tests/") else PACKAGE / name).is_file()
    )
    assert not missing, f"docs/architecture.md's Reading order names missing files: {missing}"


def test_the_lists_add_up_to_the_table() -> None:
    step = _package_lists(_details("One synchronous step"))
    sync = _package_lists(_details("One weight sync"))
    step_files = [f for files in step.values() for f in files]
    sync_files = [f for files in sync.values() for f in files]
    assert len(set(step_files)) == len(step_files) and len(set(sync_files)) == len(sync_files)
    assert _table_row("one synchronous step, version-only sync") == (len(step_files), len(step))
    assert _table_row("one weight sync, version-only") == (len(sync_files), len(sync))
    assert set(sync_files) <= set(step_files), "a file of the sync is missing from the step"
    # The files a full manifest adds, named once under the step's list.
    added = PATH.findall(_details("One synchronous step").split("A full-manifest sync adds")[1])
    assert not set(added) & set(step_files)
    full_packages = len(step.keys() | {f.split("/")[0] for f in added})
    assert _table_row("one synchronous step, full-manifest sync") == (
        len(step_files) + len(added),
        full_packages,
    )
    sync_packages = len(sync.keys() | {f.split("/")[0] for f in added})
    assert _table_row("one weight sync, full manifest") == (
        len(sync_files) + len(added),
        sync_packages,
    )


def test_the_like_for_like_counts_leave_out_only_the_files_named() -> None:
    section = _section()
    paragraph = section[section.index("The review's walk left out") :].split("\n\n")[0]
    left_out = set(PATH.findall(paragraph))
    step_block = _details("One synchronous step")
    step = {f for files in _package_lists(step_block).values() for f in files}
    added = set(PATH.findall(step_block.split("A full-manifest sync adds")[1]))
    sync = {f for files in _package_lists(_details("One weight sync")).values() for f in files}
    spelled = re.search(r"Without those (\w+), like for like", " ".join(paragraph.split()))
    assert len(left_out) == _NUMBERS.index(spelled.group(1)), (spelled.group(1), left_out)
    assert left_out <= step, left_out - step
    like_step, like_sync = (step | added) - left_out, (sync | added) - left_out
    packages = len({f.split("/")[0] for f in like_step})
    assert f"the step is {len(like_step)} files in {packages}" in " ".join(paragraph.split())
    packages = len({f.split("/")[0] for f in like_sync})
    assert f"the full sync {len(like_sync)} files in {packages}" in " ".join(paragraph.split())
