"""A quorum that misses the step's pods is asked for again after
trainer.replication.quorum_retry_seconds, doubled at each attempt up to 1 s (docs/config.md,
"Under load"): the pauses of CrossPodReplica.begin, with torchft's manager replaced by one
whose every quorum holds a replica of a pod the step does not name."""

from __future__ import annotations

from typing import Any

import pytest

from podrl.config.trainer import ReplicationConfig
from podrl.trainer import replication
from podrl.trainer.replication import CrossPodReplica, UnadmittedReplicaError
from podrl.v1 import trainer_pb2


class _StrangerQuorums:
    def batches_committed(self) -> int:
        return 0

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def start_quorum(self, timeout: object) -> None:
        raise UnadmittedReplicaError("the quorum holds pod-9, not in this step")


class _EnoughPausesError(Exception):
    pass


def test_the_quorum_is_asked_again_after_quorum_retry_seconds_doubling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 5:
            raise _EnoughPausesError

    monkeypatch.setattr(replication.time, "sleep", sleep)
    # Built without torchft: begin() reads only the settings, the manager and the pod group.
    replica = CrossPodReplica.__new__(CrossPodReplica)
    replica.settings = ReplicationConfig(quorum_retry_seconds=0.3)
    replica.manager = _StrangerQuorums()
    replica._pod_group = None
    with pytest.raises(_EnoughPausesError):
        replica.begin(
            trainer_pb2.TrainRequest(pod_ids=["pod-0"]),
            version=lambda: 0,
            check=lambda: None,
            cancelled=lambda: False,
        )
    assert pauses == [0.3, 0.6, 1.0, 1.0, 1.0]
