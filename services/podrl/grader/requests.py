"""Build Score requests from task items (what the controller sends to the grader)."""

from __future__ import annotations

from podrl.tasks.base import PromptItem
from podrl.v1 import grader_pb2


def score_item(item: PromptItem, completion: str, sample: int) -> grader_pb2.ScoreItem:
    """The ScoreItem for completion number ``sample`` of ``item``; its id is ``{item.id}#{sample}``
    (unique per completion, so the reply maps back to it)."""
    return grader_pb2.ScoreItem(
        id=f"{item.id}#{sample}",
        prompt=item.prompt,
        completion=completion,
        reference=item.reference,
        task=item.task,
        metadata=item.metadata,
    )
