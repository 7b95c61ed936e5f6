"""The built-in environments: ``calculator`` (a tool the model calls) and ``guess_number`` (a game
with feedback)."""

from __future__ import annotations

import ast
import math
import operator
import random
import re
from collections.abc import Callable, Mapping

from podrl.environments.base import Environment, StepResult

_CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GUESS = re.compile(r"<guess>\s*(-?\d+)\s*</guess>")

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[float], float]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


class CalculatorError(ValueError):
    """An expression the calculator does not evaluate; its message is the tool's reply."""


class Calculator(Environment):
    """Arithmetic as a tool. A turn that holds ``<calc>EXPR</calc>`` gets
    ``<result>VALUE</result>`` (only the first call counts: the generator stops at
    ``</calc>``); a malformed expression gets ``<result>error: WHY</result>``, a failed tool
    call, and the episode goes on. A turn without a call is the final answer: reward 1.0 when
    the text inside its last ``<answer>…</answer>`` equals the reference (both stripped), else
    0.0, and the episode ends.

    EXPR: integers and decimals, ``+ - * / // % **`` and parentheses, at most
    ``max_expression_chars`` characters; results beyond ``±max_magnitude`` and exponents above
    ``max_exponent`` are errors, so no expression can make the tool slow."""

    def __init__(
        self,
        max_expression_chars: int = 200,
        max_exponent: int = 64,
        max_magnitude: float = 1e30,
    ) -> None:
        self.max_expression_chars = max_expression_chars
        self.max_exponent = max_exponent
        self.max_magnitude = max_magnitude
        self.reference = ""

    def reset(self, prompt: str, reference: str, metadata: Mapping[str, str], seed: int) -> str:
        self.reference = reference.strip()
        return ""

    def step(self, action: str) -> StepResult:
        call = _CALC.search(action)
        if call is not None:
            try:
                value = self.evaluate(call.group(1))
            except CalculatorError as err:
                return StepResult(f"<result>error: {err}</result>", tool_calls=1, tool_errors=1)
            return StepResult(f"<result>{value}</result>", tool_calls=1)
        answers = _ANSWER.findall(action)
        correct = bool(answers) and answers[-1].strip() == self.reference
        return StepResult(reward=1.0 if correct else 0.0, done=True)

    def evaluate(self, expression: str) -> str:
        """``expression``'s value as text: an integer without a decimal point, else up to 12
        significant digits."""
        if len(expression) > self.max_expression_chars:
            raise CalculatorError(
                f"the expression has {len(expression)} characters; at most "
                f"{self.max_expression_chars} are allowed"
            )
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise CalculatorError(f"cannot parse {expression.strip()!r}") from None
        value = self._value(tree.body)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value) if isinstance(value, int) else format(value, ".12g")

    def _value(self, node: ast.expr) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._value(node.left), self._value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise CalculatorError(f"exponents above {self.max_exponent} are not allowed")
            try:
                return self._bounded(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError(f"results beyond ±{self.max_magnitude:g}") from None
        raise CalculatorError(
            "only numbers, + - * / // % ** and parentheses are allowed "
            f"(found {type(node).__name__})"
        )

    def _bounded(self, value: float) -> float:
        if isinstance(value, complex) or not math.isfinite(value):
            raise CalculatorError("the result is not a real number")
        if abs(value) > self.max_magnitude:
            raise CalculatorError(f"results beyond ±{self.max_magnitude:g} are not allowed")
        return value


class GuessNumber(Environment):
    """Guess a whole number from ``low`` to ``high``. Each turn's ``<guess>N</guess>`` gets
    ``higher``, ``lower`` or ``correct``; the right guess within ``max_guesses`` turns ends the
    episode with reward 1.0, the ``max_guesses``-th wrong one (or a turn without a guess, which
    costs a turn) with 0.0. The number is the item's reference when it has one, else drawn from
    the seed."""

    def __init__(self, low: int = 1, high: int = 100, max_guesses: int = 7) -> None:
        if low > high or max_guesses < 1:
            raise ValueError(
                f"guess_number needs low <= high and max_guesses >= 1 (got low {low}, "
                f"high {high}, max_guesses {max_guesses})"
            )
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.secret = low
        self.guesses = 0

    def reset(self, prompt: str, reference: str, metadata: Mapping[str, str], seed: int) -> str:
        if reference.strip():
            self.secret = int(reference)
            if not self.low <= self.secret <= self.high:
                raise ValueError(
                    f"the reference {self.secret} lies outside {self.low}..{self.high}"
                )
        else:
            self.secret = random.Random(seed).randint(self.low, self.high)
        self.guesses = 0
        return (
            f"I am thinking of a whole number from {self.low} to {self.high}. You have "
            f"{self.max_guesses} guesses; reply with <guess>N</guess>."
        )

    def step(self, action: str) -> StepResult:
        self.guesses += 1
        out_of_guesses = self.guesses >= self.max_guesses
        found = _GUESS.findall(action)
        if not found:
            reply = f"no guess: reply with <guess>N</guess>, N from {self.low} to {self.high}"
            return StepResult(reply, done=out_of_guesses)
        guess = int(found[-1])
        if guess == self.secret:
            return StepResult("correct", reward=1.0, done=True)
        return StepResult("higher" if guess < self.secret else "lower", done=out_of_guesses)


#: Built-in environments by the name Reset uses.
BUILTIN_ENVIRONMENTS: dict[str, type[Environment]] = {
    "calculator": Calculator,
    "guess_number": GuessNumber,
}
