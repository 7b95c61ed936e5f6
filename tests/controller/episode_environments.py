"""A plug-in environment for the episode runner's tests: three turns, each answered with a
reply naming the turn, reward 1.0 at the end; a prompt that starts with ``EXIT`` kills its
worker on the second turn, one that starts with ``HANG`` never answers it."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping

from podrl.environments import Environment, StepResult

TURNS = 3


class Scripted(Environment):
    def __init__(self) -> None:
        self.prompt = ""
        self.turns = 0

    def reset(self, prompt: str, reference: str, metadata: Mapping[str, str], seed: int) -> str:
        self.prompt = prompt
        return ""

    def step(self, action: str) -> StepResult:
        self.turns += 1
        if self.turns == 2 and self.prompt.startswith("EXIT"):
            os._exit(3)
        if self.turns == 2 and self.prompt.startswith("HANG"):
            while True:
                time.sleep(60)
        done = self.turns == TURNS
        return StepResult(
            "" if done else f"\n[reply {self.turns}]\n",
            reward=1.0 if done else 0.0,
            done=done,
            tool_calls=1,
        )


class Parity(Scripted):
    """``Scripted`` whose final reward is the parity of the first action's length, so a
    group of episodes has reward variance and trains."""

    def __init__(self) -> None:
        super().__init__()
        self.first = ""

    def step(self, action: str) -> StepResult:
        self.first = self.first or action
        result = super().step(action)
        if result.done:
            reward = len(self.first) % 2
            return StepResult(result.observation, reward, done=True, tool_calls=result.tool_calls)
        return result
