"""Per-token log-probabilities read off an in-process TrainerEngine's full logits."""

from __future__ import annotations

import torch

from podrl.trainer.engine import TrainerEngine
from tests.trainer.rank_worker import policy_logits


def trainer_logprobs(engine: TrainerEngine, request) -> list[list[float]]:
    """log pi(token) of every completion token, from the full logits of each sequence."""
    out = []
    for seq in request.sequences:
        ids = torch.tensor([list(seq.prompt_ids) + list(seq.completion_ids)])
        logp = torch.log_softmax(policy_logits(engine, ids)[0].double(), dim=-1)
        start = len(seq.prompt_ids) - 1  # the logits at i predict token i + 1
        out.append([logp[start + t, token].item() for t, token in enumerate(seq.completion_ids)])
    return out
