"""The example plug-in of docs/environments.md (examples/environments/hangman.py) is a valid
environment: the service's start-up check accepts it with its params, and an episode plays as
its docstring says."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from podrl.config.environments import EnvironmentsConfig
from podrl.environments import StepResult
from podrl.environments.isolation import resolve_environments

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "environments"


@pytest.fixture
def hangman_class(monkeypatch: pytest.MonkeyPatch) -> type:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from hangman import Hangman

    return Hangman


def test_the_start_up_check_accepts_the_example(hangman_class: type) -> None:
    config = EnvironmentsConfig(
        plugins={"hangman": "hangman:Hangman"}, params={"hangman": {"max_misses": 4}}
    )
    spec = resolve_environments(config)["hangman"]
    assert (spec.path, spec.params) == ("hangman:Hangman", {"max_misses": 4})


def test_an_example_episode(hangman_class: type) -> None:
    game = hangman_class(max_misses=2)
    assert game.reset("", "Llama", {}, seed=0) == "_____ (2 misses left)"
    assert game.step("<letter>l</letter>") == StepResult("ll___ (2 misses left)")
    game = pickle.loads(pickle.dumps(game))  # as the service keeps it between turns
    assert game.step("<letter>z</letter>") == StepResult("ll___ (1 misses left)")
    assert game.step("hmm").observation.startswith("reply with <letter>x</letter>")
    assert game.step("<letter>a</letter>") == StepResult("lla_a (1 misses left)")
    assert game.step("<letter>m</letter>") == StepResult("llama", reward=1.0, done=True)


def test_the_example_ends_after_max_misses(hangman_class: type) -> None:
    game = hangman_class(max_misses=1)
    game.reset("", "ox", {}, seed=0)
    assert game.step("<letter>q</letter>") == StepResult("__ (0 misses left)", done=True)
