"""The built-in environments' logic, called directly (no service): every expected value here is
worked out by hand."""

from __future__ import annotations

import pickle

import pytest

from podrl.environments import StepResult
from podrl.environments.builtins import Calculator, GuessNumber


def calculator(reference: str = "56088") -> Calculator:
    environment = Calculator()
    assert environment.reset("What is 123 * 456?", reference, {}, seed=0) == ""
    return environment


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123*456", "56088"),  # 123*400 + 123*56 = 49200 + 6888
        (" 999 * 999 ", "998001"),
        ("(17 + 3) * -2", "-40"),
        ("7/2", "3.5"),
        ("6/3", "2"),  # an integral quotient prints without a decimal point
        ("7//2", "3"),
        ("-7 % 3", "2"),  # Python's modulo takes the divisor's sign
        ("2**10", "1024"),
        ("1/3", "0.333333333333"),  # 12 significant digits
        ("0.1 + 0.2", "0.3"),
    ],
)
def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    result = calculator().step(f"Let me compute. <calc>{expression}</calc>")
    assert result == StepResult(f"<result>{value}</result>", tool_calls=1)


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("1/0", "division by zero"),
        ("__import__('os').system('true')", "only numbers, + - * / // % ** and parentheses"),
        ("2**65", "exponents above 64"),
        ("10**20 * 10**20", "results beyond ±1e+30"),
        ("1 +", "cannot parse '1 +'"),
        ("1" * 201, "at most 200 are allowed"),
        ("True + 1", "only numbers"),
    ],
)
def test_a_malformed_expression_is_a_failed_tool_call_and_the_episode_goes_on(
    expression: str, why: str
) -> None:
    result = calculator().step(f"<calc>{expression}</calc>")
    assert result.observation.startswith("<result>error: ")
    assert why in result.observation
    assert (result.tool_calls, result.tool_errors, result.done, result.reward) == (1, 1, False, 0)


def test_only_the_first_call_of_a_turn_runs() -> None:
    result = calculator().step("<calc>2+2</calc> and <calc>3+3</calc>")
    assert result.observation == "<result>4</result>"


@pytest.mark.parametrize(
    ("answer", "reward"),
    [
        ("The product is <answer>56088</answer>", 1.0),
        ("<answer> 56088 </answer>", 1.0),  # both sides stripped
        ("<answer>1</answer> no, <answer>56088</answer>", 1.0),  # the last answer counts
        ("<answer>56,088</answer>", 0.0),  # exact: no thousands separator
        ("<answer>56087</answer>", 0.0),
        ("56088", 0.0),  # no answer tag
    ],
)
def test_a_turn_without_a_call_is_the_final_answer(answer: str, reward: float) -> None:
    assert calculator().step(answer) == StepResult(reward=reward, done=True)


def test_a_whole_calculator_episode_survives_pickling_between_turns() -> None:
    environment = calculator()
    environment = pickle.loads(pickle.dumps(environment))
    assert environment.step("<calc>123*456</calc>").observation == "<result>56088</result>"
    environment = pickle.loads(pickle.dumps(environment))
    assert environment.step("<answer>56088</answer>") == StepResult(reward=1.0, done=True)


def test_guess_number_answers_higher_and_lower_until_solved() -> None:
    game = GuessNumber(low=1, high=100, max_guesses=7)
    intro = game.reset("", "37", {}, seed=0)
    assert "from 1 to 100" in intro and "7 guesses" in intro
    assert game.step("<guess>50</guess>") == StepResult("lower")
    assert game.step("<guess>25</guess>") == StepResult("higher")
    assert game.step("maybe <guess>40</guess>") == StepResult("lower")
    assert game.step("<guess>37</guess>") == StepResult("correct", reward=1.0, done=True)


def test_guess_number_ends_unsolved_at_max_guesses() -> None:
    game = GuessNumber(low=1, high=10, max_guesses=3)
    game.reset("", "7", {}, seed=0)
    assert game.step("<guess>1</guess>") == StepResult("higher")
    no_guess = game.step("I do not know")  # costs a turn
    assert no_guess.observation.startswith("no guess") and not no_guess.done
    assert game.step("<guess>9</guess>") == StepResult("lower", done=True)


def test_guess_number_draws_from_the_seed_without_a_reference() -> None:
    drawn = set()
    for seed in range(20):
        game = GuessNumber(low=1, high=5)
        game.reset("", "", {}, seed=seed)
        again = GuessNumber(low=1, high=5)
        again.reset("", "", {}, seed=seed)
        assert game.secret == again.secret  # the same seed, the same number
        drawn.add(game.secret)
    assert drawn == {1, 2, 3, 4, 5}


def test_guess_number_refuses_a_reference_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"outside 1\.\.100"):
        GuessNumber().reset("", "101", {}, seed=0)
