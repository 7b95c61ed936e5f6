"""Tiny built-in procedural tasks with short answers, learnable by a small character model.

- ``add``: ``"3+5="`` -> ``"8"`` (operands in [min_value, max_value]);
- ``mul``: ``"123*456="`` -> ``"56088"`` (operands in [min_value, max_value]; 3-digit products are
  beyond the tiny model's head, the calculator environment's task);
- ``copy``: ``"copy:abc="`` -> ``"abc"``;
- ``reverse``: ``"reverse:abc="`` -> ``"cba"`` (strings of min_length..max_length characters).
"""

from __future__ import annotations

import random

from podrl.config.tasks import ProceduralSourceConfig
from podrl.tasks.task_stream import Record, RecordStream


class ProceduralRecords(RecordStream):
    def __init__(self, config: ProceduralSourceConfig, seed: int) -> None:
        self._config, self._seed = config, seed

    def record(self, index: int) -> Record:
        cfg = self._config
        # A string seed is hashed with SHA-512 by `random`: stable across runs and platforms.
        rng = random.Random(f"{self._seed}:{index}")
        if cfg.generator in ("add", "mul"):
            a = rng.randint(cfg.min_value, cfg.max_value)
            b = rng.randint(cfg.min_value, cfg.max_value)
            if cfg.generator == "add":
                return Record(f"{a}+{b}=", str(a + b), {"a": str(a), "b": str(b)})
            return Record(f"{a}*{b}=", str(a * b), {"a": str(a), "b": str(b)})
        length = rng.randint(cfg.min_length, cfg.max_length)
        text = "".join(rng.choice(cfg.alphabet) for _ in range(length))
        answer = text if cfg.generator == "copy" else text[::-1]
        return Record(f"{cfg.generator}:{text}=", answer, {"text": text})
