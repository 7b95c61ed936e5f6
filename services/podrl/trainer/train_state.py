"""TrainState: the trainer's progress beside its model and optimizer, with one owner.

The engine owns one per rank; only its methods change it. It holds the policy version (the
number of optimizer steps applied: the trainer keeps no separate step counter), the last applied
Train and its reply, the LR schedule and torch's RNG states. :meth:`TrainState.state_dict` is what a
checkpoint stores and a healing pod receives (``{"model", "optim", "train_state"}``, see
``TrainerEngine.state_dict``); it is JSON-ready (RNG states as base64), so the checkpoint writes
it into ``trainer_state.json`` as it is.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch

from podrl.v1 import trainer_pb2


@dataclass(frozen=True)
class AppliedTrain:
    """The last Train this engine applied: its ``TrainRequest.batch_id`` ("" if it had none)
    and its reply, kept so that a retry of the same batch is answered without a second step."""

    batch_id: str
    response: trainer_pb2.TrainResponse


def _rng_text(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _rng_tensor(text: str) -> torch.Tensor:
    data = bytearray(base64.b64decode(text.encode("ascii")))
    return torch.frombuffer(data, dtype=torch.uint8).clone()


class TrainState:
    """See the module docstring."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, device: torch.device):
        self.scheduler = scheduler
        self._device = device
        self.policy_version = 0
        self.last_train: AppliedTrain | None = None

    @property
    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def advance(self) -> int:
        """The optimizer just stepped: the schedule and the version move with it. The new
        version."""
        self.scheduler.step()
        self.policy_version += 1
        return self.policy_version

    def applied(self, batch_id: str, response: trainer_pb2.TrainResponse) -> None:
        """Remember the Train just applied, so a retry of ``batch_id`` gets ``response``."""
        self.last_train = AppliedTrain(batch_id, response)

    def state_dict(self) -> dict[str, Any]:
        """Version, schedule and RNG states (JSON-ready). The last reply is not in it: it
        belongs to this process's weights, not to the weights that load this state."""
        return {
            "policy_version": self.policy_version,
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": _rng_text(torch.get_rng_state()),
            "rng_cuda": [_rng_text(s) for s in torch.cuda.get_rng_state_all()]
            if self._device.type == "cuda"
            else [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's or a peer pod's state. The stored reply is dropped: it belongs to
        weights that are gone, so a batch sent again now trains again."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.policy_version = int(state["policy_version"])
        self.last_train = None
        torch.set_rng_state(_rng_tensor(state["rng_cpu"]))
        if self._device.type == "cuda" and state["rng_cuda"]:
            states = [_rng_tensor(s) for s in state["rng_cuda"]]
            # Another machine may have another GPU count: its states do not map onto these.
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
