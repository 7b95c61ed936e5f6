"""A reward plug-in that takes its time, so a test can kill the grader mid-step."""

import time


def slow_exact_match(completion: str, reference: str, *, delay: float = 0.2) -> float:
    time.sleep(delay)
    return float(completion.split("\n")[0].strip() == reference.strip())
