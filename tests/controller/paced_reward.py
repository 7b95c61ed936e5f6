"""A reward plug-in for the scaling test: its value varies with the completion (so a random
model's groups have reward variance and every step trains), and it takes ``delay`` seconds
while the file ``gate`` exists, so the test can slow the steps down while pods start."""

import os
import time


def paced_varied(completion: str, reference: str, *, gate: str, delay: float = 1.0) -> float:
    if os.path.exists(gate):
        time.sleep(delay)
    return (sum(map(ord, completion)) % 4) / 3.0
