"""Stand-in generator and environment stubs for the episode runner's fast tests (plain objects,
no services): the generator samples two tokens per turn, the environment plays three turns of
one tool call each."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import grpc

from podrl.controller.rollout.episodes import EpisodeSettings
from podrl.v1 import common_pb2, environment_pb2, generator_pb2

TURNS = 3


class StandInGenerator:
    """Generate: two tokens per turn over whatever prefix; Tokenize: one id per character.
    ``versions``: per Generate call in order, (policy_version, last_policy_version) of its
    sample (a weight update landed in flight when they differ); (4, 4) once they run out."""

    def __init__(self, versions: Sequence[tuple[int, int]] = ()) -> None:
        self.versions = list(versions)
        self._lock = threading.Lock()

    def Generate(self, request: Any, timeout: float) -> Any:
        with self._lock:
            first, last = self.versions.pop(0) if self.versions else (4, 4)
        prompt = request.prompts[0]
        ids = list(prompt.token_ids) or [ord(c) for c in prompt.text]
        sample = common_pb2.Sample(
            prompt_id=prompt.id,
            prompt_token_ids=ids,
            token_ids=[7, 8],
            logprobs=[-0.5, -0.25],
            text="<calc>1+1</calc>",
            policy_version=first,
            last_policy_version=last,
        )
        return generator_pb2.GenerateResponse(samples=[sample], policy_version=first)

    def Tokenize(self, request: Any, timeout: float) -> Any:
        return generator_pb2.TokenizeResponse(
            tokens=[generator_pb2.TokenIds(ids=[ord(c) for c in t]) for t in request.texts]
        )


class Refused(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.INTERNAL

    def details(self) -> str:
        return "the worker died (exit code 3)"


class StandInEnvironment:
    """Three turns, one tool call each (the second a failed one); Step of turn ``hold_turn``
    waits for ``release``; a prompt starting with FAIL fails its episode there."""

    def __init__(self, hold_turn: int = 0) -> None:
        self.hold_turn = hold_turn
        self.release = threading.Event()
        self.held = 0
        self.turns: dict[str, int] = {}
        self.prompts: dict[str, str] = {}
        self._lock = threading.Lock()

    def Reset(self, request: Any, timeout: float) -> Any:
        self.turns[request.episode_id] = 0
        self.prompts[request.episode_id] = request.prompt
        return environment_pb2.ResetResponse(observation="")

    def Step(self, request: Any, timeout: float) -> Any:
        self.turns[request.episode_id] += 1
        turn = self.turns[request.episode_id]
        if turn == self.hold_turn:
            with self._lock:
                self.held += 1
            assert self.release.wait(10)
            if self.prompts[request.episode_id].startswith("FAIL"):
                raise Refused()
        done = turn == TURNS
        return environment_pb2.StepResponse(
            observation="" if done else "<result>2</result>",
            reward=1.0 if done else 0.0,
            done=done,
            turn=turn,
            tool_calls=1,
            tool_errors=int(turn == 2),
        )

    def Close(self, request: Any, timeout: float) -> Any:
        return environment_pb2.CloseResponse(closed=True)


def stand_in_settings() -> EpisodeSettings:
    """Episode settings for the stand-ins: their environment, turns ending at ``</calc>``,
    limits the stand-ins never reach."""
    return EpisodeSettings(
        environment="calc",
        sampling=common_pb2.SamplingParams(max_tokens=4),
        turn_stop=["</calc>"],
        max_episode_tokens=4096,
        max_turns=8,
    )
