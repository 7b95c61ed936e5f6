"""The batch-id grammar has one writer and one reader: what the loop sends, a restart reads."""

from __future__ import annotations

import pytest

from podrl.controller.step.batch import (
    StepBatchId,
    attempt_of,
    names_step_batch,
    process_prefix,
)


def test_a_pods_batch_id_reads_back_as_its_step_attempt() -> None:
    prefix = process_prefix("run.v2")  # a run name with a dot, as config allows
    assert prefix.startswith("run.v2:") and len(prefix) == len("run.v2:") + 8
    step = StepBatchId(prefix, 12, 3)
    assert str(step) == f"{prefix}:12:3"
    pod_batch = step.for_pod(2, "worker.example-1")  # worker ids may hold dots too
    assert pod_batch == f"{prefix}:12:3.2@worker.example-1"
    assert attempt_of(pod_batch) == str(step)
    assert names_step_batch(pod_batch, str(step)) and names_step_batch(str(step), str(step))


@pytest.mark.parametrize(
    ("last", "step", "named"),
    [
        ("run:abc:4:1.1@local-0", "run:abc:4:1", True),
        ("run:abc:4:1.3@local-2", "run:abc:4:1", True),
        ("run:abc:4:1", "run:abc:4:1", True),
        # Another attempt or step whose id starts with the same digits is not this one.
        ("run:abc:4:10.1@local-0", "run:abc:4:1", False),
        ("run:abc:4:2.1@local-0", "run:abc:4:1", False),
        ("run:abc:4:1.1@local-0", "run:abc:4", False),
        # Unknown on either side: nothing is named.
        ("", "run:abc:4:1", False),
        ("run:abc:4:1.1@local-0", "", False),
        ("intruder", "run:abc:4:1", False),
    ],
)
def test_names_step_batch(last: str, step: str, named: bool) -> None:
    assert names_step_batch(last, step) is named


@pytest.mark.parametrize("text", ["run:abc:4:1", "run:abc:4:1.x@local-0", "run:abc:4:1.1@", "@p"])
def test_what_is_not_a_pods_batch_id_has_no_attempt(text: str) -> None:
    assert attempt_of(text) is None
