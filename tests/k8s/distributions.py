"""What a set of requirements pulls in from the installed distributions' own metadata."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def requirement_closure(requirements: list[str], extras: set[str]) -> set[str]:
    """Names of the installed distributions these requirements pull in (markers evaluated)."""
    seen: set[str] = set()
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, active = todo.pop()
        environments = [{"extra": e} for e in active] or [{"extra": ""}]
        if req.marker and not any(req.marker.evaluate(env) for env in environments):
            continue
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [(Requirement(r), set(req.extras)) for r in requires]
    return seen
