"""The reward of bench/scaling.py: it varies with the completion, so a random-init model's
groups have reward variance and every step trains (and syncs weights)."""


def varied(completion: str, reference: str) -> float:
    return (sum(map(ord, completion)) % 4) / 3.0
