"""An example environment plug-in (docs/environments.md, "Writing an environment"): guess the
item's reference word one letter at a time.

Each turn's ``<letter>x</letter>`` is answered with the word as known so far (``_a__a_``) and the
number of misses left; revealing the whole word ends the episode with reward 1.0, running out of
misses with 0.0. Run it with::

    environments:
      plugins: {hangman: "hangman:Hangman"}
      params: {hangman: {max_misses: 4}}

and ``examples/environments`` on the environment service's ``PYTHONPATH``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from podrl.environments import Environment, StepResult

_LETTER = re.compile(r"<letter>\s*([a-z])\s*</letter>")


class Hangman(Environment):
    def __init__(self, max_misses: int = 6) -> None:
        self.max_misses = max_misses
        self.word = ""
        self.guessed: set[str] = set()
        self.misses = 0

    def reset(self, prompt: str, reference: str, metadata: Mapping[str, str], seed: int) -> str:
        self.word = reference.strip().lower()
        return self._board()

    def step(self, action: str) -> StepResult:
        found = _LETTER.findall(action.lower())
        if not found:  # a malformed turn is answered, not raised: the episode goes on
            return StepResult(f"reply with <letter>x</letter>; {self._board()}")
        letter = found[-1]
        if letter not in self.word and letter not in self.guessed:
            self.misses += 1
        self.guessed.add(letter)
        if all(char in self.guessed for char in self.word):
            return StepResult(self.word, reward=1.0, done=True)
        return StepResult(self._board(), done=self.misses >= self.max_misses)

    def _board(self) -> str:
        shown = "".join(char if char in self.guessed else "_" for char in self.word)
        return f"{shown} ({self.max_misses - self.misses} misses left)"
