"""The grader's ScoreItem request built from a task item: how the controller asks for a score."""

from __future__ import annotations

from podrl.tasks.task_stream import PromptItem
from podrl.v1 import grader_pb2


def build_score_item(item: PromptItem, completion: str, sample_id: str) -> grader_pb2.ScoreItem:
    """The ScoreItem asking the grader to score ``completion`` of ``item``.

    ``sample_id`` names this one completion; the grader echoes it in ``ItemScore.id``, which is
    how the caller maps each reply back (the controller passes its per-sample id,
    ``"{item.id}#{index}"``). Prompt, reference, task and metadata come from the item, so the
    grader sees exactly what the task source produced.
    """
    return grader_pb2.ScoreItem(
        id=sample_id,
        prompt=item.prompt,
        completion=completion,
        reference=item.reference,
        task=item.task,
        metadata=item.metadata,
    )
