"""Each built-in reward on known right and wrong answers."""

from __future__ import annotations

import json

import pytest

from podrl.grader.rewards.scoring import (
    char_match,
    exact_match,
    format_reward,
    length_penalty,
    math_verify_reward,
    reasoning_gym_score,
    regex_match,
)


@pytest.mark.parametrize(
    ("reference", "answer"),
    [
        ("1/2", "0.5"),  # fraction vs decimal
        ("\\frac{1}{2}", "The answer is $\\boxed{0.5}$"),  # LaTeX fraction vs boxed decimal
        ("\\frac{3}{4}", "$\\frac{6}{8}$"),  # unreduced fraction
        ("$x^2+2x+1$", "$(x+1)^2$"),  # symbolic equivalence
        ("$\\{1,2\\}$", "$\\{2,1\\}$"),  # sets ignore order
        ("$50\\%$", "$0.5$"),  # percentages
        ("$10\\text{ cm}$", "$10$"),  # a text unit is dropped
        ("$\\sqrt{8}$", "$2\\sqrt{2}$"),  # radicals
    ],
)
def test_math_verify_accepts_equivalent_answers(reference: str, answer: str) -> None:
    assert math_verify_reward(answer, reference) == 1.0


@pytest.mark.parametrize(
    ("reference", "answer"),
    [
        ("1/2", "0.25"),
        ("\\frac{3}{4}", "$\\frac{4}{3}$"),
        ("$x^2+2x+1$", "$(x-1)^2$"),
        ("5", "six"),
        ("5", ""),
    ],
)
def test_math_verify_rejects_wrong_answers(reference: str, answer: str) -> None:
    assert math_verify_reward(answer, reference) == 0.0


def test_math_verify_reads_the_answer_tag_when_asked() -> None:
    completion = "2 apples and 3 apples <answer>\\frac{10}{2}</answer>"
    assert math_verify_reward(completion, "5", answer_tag="answer") == 1.0
    assert math_verify_reward("5 but no tags", "5", answer_tag="answer") == 0.0


def test_exact_match() -> None:
    assert exact_match(" 42\n", "42") == 1.0
    assert exact_match("42", "42.0") == 0.0
    assert exact_match(" 42", "42", strip=False) == 0.0
    assert exact_match("Paris", "paris") == 0.0
    assert exact_match("Paris", "paris", case_sensitive=False) == 1.0
    assert exact_match("so <answer>7</answer>", "7", answer_tag="answer") == 1.0
    assert exact_match("<answer>8</answer>", "7", answer_tag="answer") == 0.0
    assert exact_match("7", "7", answer_tag="answer") == 0.0  # the tags are required
    assert exact_match("7\n+1=8 and more", "7", stop="\n") == 1.0
    assert exact_match("7\n+1=8 and more", "7") == 0.0


def test_regex_match() -> None:
    assert regex_match("result: 12 apples", "12", pattern=r"\d+") == 1.0
    assert regex_match("no digits", "12", pattern=r"\d+") == 0.0
    assert regex_match("12 apples", "12", pattern=r"\d+", full_match=True) == 0.0
    assert regex_match("Answer: 12", "12", pattern=r"Answer: (\d+)", group=1) == 1.0
    assert regex_match("Answer: 13", "12", pattern=r"Answer: (\d+)", group=1) == 0.0
    assert regex_match("Answer: 12", "12", pattern=r"Answer: (?P<n>\d+)", group="n") == 1.0


def test_format_reward() -> None:
    assert format_reward("think... <answer>4</answer>", "4") == 1.0
    assert format_reward("<answer>4</answer>", "wrong answers still have the format") == 1.0
    assert format_reward("4", "4") == 0.0
    assert format_reward("<answer> </answer>", "4") == 0.0  # empty
    assert format_reward("<answer>4</answer><answer>5</answer>", "4") == 0.0  # two answers
    assert format_reward("text <answer>4</answer>", "4", strict=True) == 0.0
    assert format_reward("  <answer>4</answer>\n", "4", strict=True) == 1.0
    assert format_reward("<final>4</final>", "4", tag="final") == 1.0


def test_char_match_gives_partial_credit() -> None:
    assert char_match("cba", "cba") == 1.0
    assert char_match("cbx", "cba") == pytest.approx(2 / 3)
    assert char_match("cbaaa", "cba") == pytest.approx(3 / 5)  # extra characters cost
    assert char_match("xyz", "cba") == 0.0
    assert char_match("", "cba") == 0.0
    assert char_match("cb\nxyz", "cba", stop="\n") == pytest.approx(2 / 3)


def test_length_penalty() -> None:
    assert length_penalty("x" * 10, "", free_chars=20, max_chars=60) == 0.0
    assert length_penalty("x" * 40, "", free_chars=20, max_chars=60) == pytest.approx(-0.5)
    assert length_penalty("x" * 500, "", free_chars=20, max_chars=60) == pytest.approx(-1.0)
    assert length_penalty("x" * 500, "", max_chars=60, penalty=0.2) == pytest.approx(-0.2)
    with pytest.raises(ValueError, match="max_chars"):
        length_penalty("x", "", free_chars=5, max_chars=5)


def test_reasoning_gym_scorer_uses_the_dataset_entry() -> None:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("leg_counting", seed=3, size=5)
    entry = dataset[0]
    metadata = {
        "reasoning_gym_dataset": "leg_counting",
        "reasoning_gym_entry": json.dumps(entry, default=list),
    }
    right = f"Counting... <answer>{entry['answer']}</answer>"
    wrong = f"<answer>{int(entry['answer']) + 1}</answer>"
    assert reasoning_gym_score(right, entry["answer"], metadata=metadata) == 1.0
    assert reasoning_gym_score(wrong, entry["answer"], metadata=metadata) == 0.0
    assert reasoning_gym_score(entry["answer"], entry["answer"], metadata=metadata) == 0.0
    bare = reasoning_gym_score(entry["answer"], entry["answer"], metadata=metadata, answer_tag=None)
    assert bare == 1.0


def test_reasoning_gym_scorer_needs_a_dataset_name() -> None:
    with pytest.raises(ValueError, match="dataset"):
        reasoning_gym_score("1", "1", metadata={})
