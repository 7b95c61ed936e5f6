"""docs/architecture.md's "How many files a step and a sync touch", recorded: a CPU run with one
pod whose every service process records which files of services/podrl/ run (tests/harness/walk.py,
about two minutes on two cores). A path that runs more files than the table says, or a file its
list lacks, fails here: a split or a new helper on the path must be written into the docs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness.walk import PATHS, documented, packages, record_run, walk

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, set[str]]]:
    folder: Path = tmp_path_factory.mktemp("walk")
    return walk(record_run(folder))


@pytest.mark.parametrize("path", list(PATHS))
def test_the_docs_list_every_file_the_path_runs(
    recorded: dict[str, dict[str, set[str]]], path: str
) -> None:
    count, listed = documented()[path]
    ran = recorded[path]
    unlisted = {name: sorted(threads) for name, threads in ran.items() if name not in listed}
    assert not unlisted, f"{PATHS[path]}: ran, but docs/architecture.md lacks {unlisted}"
    assert len(ran) <= count, f"{PATHS[path]}: {len(ran)} files ran; the table says {count}"
    assert len(packages(ran)) <= len(packages(listed))
