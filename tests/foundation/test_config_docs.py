"""Every row of a ``| field | default | what it does |`` table of docs/config.md names a field of
RunConfig (``section.sub.field``) and states its default as the code has it."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from podrl.config import RunConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
ROW = re.compile(r"^\| `([a-z_.]+)` \| `?([^`|]*?)`? \|", re.M)


def _documented(text: str) -> list[tuple[str, str]]:
    """(field, default) of each row under a ``| field | default |`` header."""
    rows = []
    for table in re.split(r"\n\n", text):
        if table.startswith("| field | default |"):
            rows += ROW.findall(table)
    return rows


def _default(path: str) -> object:
    model: type[BaseModel] = RunConfig
    *sections, name = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation  # type: ignore[assignment]
    field = model.model_fields[name]
    return field.get_default(call_default_factory=True)


def _shown(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"  # the page writes 30 for 30.0
    return str(value)


def test_the_documented_fields_exist_with_their_defaults() -> None:
    rows = _documented(PAGE.read_text())
    assert len(rows) >= 5
    wrong = [
        f"{path}: the page says {shown!r}, the config {_shown(_default(path))!r}"
        for path, shown in rows
        if _shown(_default(path)) != shown
    ]
    assert not wrong


def test_a_wrong_default_is_caught() -> None:
    page = "| field | default | what it does |\n| --- | --- | --- |\n| `loop.mode` | `async` | x |"
    ((path, shown),) = _documented(page)
    assert _shown(_default(path)) != shown
