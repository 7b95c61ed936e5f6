"""Records generated locally by a ``reasoning-gym`` dataset (no downloads).

Index ``i`` lies in chunk ``c = i // chunk_size`` at offset ``i % chunk_size``; chunk 0 is the
dataset built with ``seed``, chunk ``c > 0`` the one built with a seed hashed from (seed, c), so
the stream is endless and every item is fixed by (seed, i). (Not ``seed + c`` as reasoning-gym's
ReseedingDataset does: its datasets seed item ``j`` with ``seed + j``, so consecutive chunks would
repeat each other shifted by one.)
"""

from __future__ import annotations

import json
from typing import Any

from podrl.config.tasks import ReasoningGymSourceConfig
from podrl.tasks.task_stream import Record, RecordStream, derive_seed

ENTRY_KEY = "reasoning_gym_entry"
"""Metadata key holding the dataset entry as JSON; the reasoning_gym reward scores with it."""
DATASET_KEY = "reasoning_gym_dataset"


class ReasoningGymRecords(RecordStream):
    def __init__(self, config: ReasoningGymSourceConfig, seed: int, field: str) -> None:
        import reasoning_gym  # imported here: only tasks that use it pay its import time

        if config.dataset not in reasoning_gym.factory.DATASETS:
            known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
            raise ValueError(
                f"{field}.dataset: unknown reasoning-gym dataset {config.dataset!r}; known: {known}"
            )
        self._create = reasoning_gym.create_dataset
        self._config, self._seed, self._field = config, seed, field
        self._chunk: tuple[int, Any] | None = None
        self._dataset(0)  # bad params fail now, naming the field

    def _dataset(self, chunk: int) -> Any:
        if self._chunk is None or self._chunk[0] != chunk:
            try:
                dataset = self._create(
                    self._config.dataset,
                    seed=self._seed if chunk == 0 else derive_seed(self._seed, f"chunk:{chunk}"),
                    size=self._config.chunk_size,
                    **self._config.params,
                )
            except (TypeError, ValueError, AssertionError) as err:
                raise ValueError(
                    f"{self._field}.params: reasoning-gym rejected {self._config.params}: {err}"
                ) from None
            self._chunk = (chunk, dataset)
        return self._chunk[1]

    def record(self, index: int) -> Record:
        chunk, offset = divmod(index, self._config.chunk_size)
        entry = self._dataset(chunk)[offset]
        plain = {
            "question": entry["question"],
            "answer": entry["answer"],
            "metadata": entry.get("metadata", {}),
        }
        return Record(
            question=str(entry["question"]),
            answer=str(entry["answer"]),
            metadata={
                DATASET_KEY: self._config.dataset,
                ENTRY_KEY: json.dumps(plain, default=_jsonable),
            },
        )


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    return str(value)
