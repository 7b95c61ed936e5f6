"""Prompt templates: a str.format string or a Jinja2 template per task."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal


class TemplateError(ValueError):
    """A template that cannot be rendered for an item (bad syntax or an unknown variable)."""


class PromptTemplate:
    """Renders a task's prompt from ``question``, ``task`` and the item's metadata fields.

    ``format``: Python ``str.format`` (``"{question}\\nAnswer: "``). ``jinja``: a Jinja2 template
    with undefined variables as errors (``"{{ question }}"``, loops, chat markup, ...).
    """

    def __init__(self, text: str, kind: Literal["format", "jinja"], field: str) -> None:
        self._text, self._kind, self._field = text, kind, field
        self._jinja = None
        if kind == "jinja":
            import jinja2  # only sources with Jinja templates need it

            env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
            try:
                self._jinja = env.from_string(text)
            except jinja2.TemplateSyntaxError as err:
                raise TemplateError(f"{field}: invalid Jinja template: {err}") from None

    def render(self, variables: Mapping[str, Any]) -> str:
        try:
            if self._jinja is not None:
                return self._jinja.render(**variables)
            return self._text.format(**variables)
        except (KeyError, IndexError, ValueError) as err:
            raise TemplateError(
                f"{self._field}: cannot render with variables {sorted(variables)}: {err!r}"
            ) from None
        except Exception as err:  # jinja2.UndefinedError and friends
            raise TemplateError(f"{self._field}: {err}") from None
