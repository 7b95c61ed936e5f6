"""Records read from a JSON-lines file with configurable field names.

Pass ``e`` over the file visits every row once, in file order or (``shuffle``) in an order fixed
by (seed, e); index ``i`` is row ``order_e[i % rows]`` of pass ``e = i // rows``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from podrl.config.tasks import JsonlSourceConfig
from podrl.tasks.task_stream import Record, RecordStream


class JsonlRecords(RecordStream):
    def __init__(self, config: JsonlSourceConfig, seed: int, field: str) -> None:
        self._config, self._seed = config, seed
        self._rows = _read_rows(config, field)
        self._order: tuple[int, list[int]] | None = None

    def _pass_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self._rows)))
            if self._config.shuffle:
                random.Random(f"{self._seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    def record(self, index: int) -> Record:
        epoch, offset = divmod(index, len(self._rows))
        row_id, record = self._rows[self._pass_order(epoch)[offset]]
        return Record(
            record.question,
            record.answer,
            {**record.metadata, "row_id": row_id, "epoch": str(epoch)},
        )


def _read_rows(config: JsonlSourceConfig, field: str) -> list[tuple[str, Record]]:
    path = Path(config.path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as err:
        raise ValueError(f"{field}.path: cannot read {path}: {err.strerror}") from None
    rows: list[tuple[str, Record]] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{field}.path: {where} is not JSON: {err}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{field}.path: {where} must hold a JSON object")
        wanted = [config.prompt_field, config.answer_field, *config.metadata_fields]
        if config.id_field:
            wanted.append(config.id_field)
        for name in wanted:
            if name not in obj:
                raise ValueError(
                    f"{field}: {where} has no field {name!r} (fields: {sorted(obj)}); "
                    "set prompt_field/answer_field/id_field/metadata_fields to match the file"
                )
        row_id = str(obj[config.id_field]) if config.id_field else str(number)
        metadata = {name: _text(obj[name]) for name in config.metadata_fields}
        rows.append(
            (
                row_id,
                Record(_text(obj[config.prompt_field]), _text(obj[config.answer_field]), metadata),
            )
        )
    if not rows:
        raise ValueError(f"{field}.path: {path} holds no rows")
    return rows


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)
