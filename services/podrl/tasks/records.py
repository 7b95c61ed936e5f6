"""Random-access record streams: record ``i`` of a stream is fixed by the seed and ``i``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Record:
    """A question and its reference answer before the task's template is applied."""

    question: str
    answer: str
    metadata: dict[str, str] = field(default_factory=dict)


class RecordStream(ABC):
    """An endless, deterministic sequence of records, addressed by index."""

    @abstractmethod
    def record(self, index: int) -> Record:
        """Record number ``index`` (>= 0); the same index always gives the same record."""
