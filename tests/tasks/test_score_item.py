"""ScoreItem requests built from task items carry what the grader needs, unchanged."""

from __future__ import annotations

from podrl.tasks import PromptItem


def test_score_item_copies_the_item_and_keeps_the_callers_id() -> None:
    item = PromptItem(
        id="add/17",
        task="add",
        prompt="3+5=",
        reference="8",
        target="8\n",
        metadata={"a": "3", "b": "5"},
    )
    request = item.score_item("8\nrest", "add/17#3")
    assert request.id == "add/17#3"
    assert (request.prompt, request.completion, request.reference, request.task) == (
        "3+5=",
        "8\nrest",
        "8",
        "add",
    )
    assert dict(request.metadata) == {"a": "3", "b": "5"}
