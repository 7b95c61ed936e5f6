"""Errors the generator's engine parts raise that the servicer answers with a status code of
their own (each part's other errors live beside it)."""

from __future__ import annotations


class GeneratorUnavailableError(RuntimeError):
    """The engine cannot serve this call in its current state (sleeping, not started)."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (e.g. prompt too long); the message says why."""
