"""Injected faults for chaos tests: a named point in the code fails or stalls on request.

A fault plan comes from the environment variable ``PODRL_FAULTS``: a JSON list of rules,
read once per process. Each rule names a ``point`` (a string the code passes to :func:`hit`)
and what happens there:

    [{"point": "trainer.after_optimizer_step", "action": "raise", "rank": 1, "times": 1},
     {"point": "generator.apply_weights", "action": "delay", "seconds": 5, "times": 1}]

- ``action``: ``"raise"`` (raise :class:`InjectedFaultError`) or ``"delay"`` (sleep ``seconds``).
- ``times``: how many hits of the point trigger the rule in this process (default 1; 0 = every).
- ``skip``: hits to let through before the rule starts triggering (default 0).
- ``while_file``: the rule triggers only while this file exists (a test lifts a stall by
  deleting it); hits while it is absent are not counted.
- any other key (``rank``, ``version``, ...) must equal the keyword of the same name that the
  code passes to :func:`hit`, so one rule can target one rank or one version.

A fault point is written ``if faults.ARMED: faults.hit("point", ...)``. :data:`ARMED` is False in
every process without a plan (``PODRL_FAULTS`` unset: every run but the chaos tests), so a point
there reads one module attribute and runs no code of this module: the path of a step or a weight
sync does not pass through it. Faults exist only for tests; no config file or chart value can
set them.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

ENV_VAR = "PODRL_FAULTS"
_ACTIONS = ("raise", "delay")
_RULE_KEYS = ("point", "action", "times", "skip", "seconds", "while_file")

log = logging.getLogger(__name__)


class InjectedFaultError(RuntimeError):
    """Raised at a fault point whose rule says ``raise``."""


@dataclass
class _Rule:
    point: str
    action: str
    times: int = 1
    skip: int = 0
    seconds: float = 0.0
    while_file: str | None = None
    match: dict[str, Any] = field(default_factory=dict)
    seen: int = 0
    fired: int = 0

    def applies(self, context: dict[str, Any]) -> bool:
        if self.while_file is not None and not os.path.exists(self.while_file):
            return False
        return all(context.get(key) == value for key, value in self.match.items())


def parse(text: str) -> list[_Rule]:
    """Parse a fault plan; a malformed plan raises ValueError naming the rule and the field."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV_VAR} is not valid JSON: {exc}") from exc
    if not isinstance(raw, list):
        raise ValueError(f"{ENV_VAR} must be a JSON list of rules")
    rules = []
    for index, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("point"), str):
            raise ValueError(f"{ENV_VAR}[{index}] needs a string 'point'")
        action = item.get("action", "raise")
        if action not in _ACTIONS:
            raise ValueError(f"{ENV_VAR}[{index}].action must be one of {_ACTIONS}, got {action!r}")
        rules.append(
            _Rule(
                point=item["point"],
                action=action,
                times=int(item.get("times", 1)),
                skip=int(item.get("skip", 0)),
                seconds=float(item.get("seconds", 0.0)),
                while_file=item.get("while_file"),
                match={k: v for k, v in item.items() if k not in _RULE_KEYS},
            )
        )
    return rules


_lock = threading.Lock()
_rules: list[_Rule] | None = None

ARMED: bool = bool(os.environ.get(ENV_VAR))
"""Whether this process has a fault plan; fault points call :func:`hit` only then."""


def _plan() -> list[_Rule]:
    global _rules
    if _rules is None:
        _rules = parse(os.environ[ENV_VAR]) if os.environ.get(ENV_VAR) else []
    return _rules


def reset(text: str | None = None) -> None:
    """Replace the process's fault plan (tests); ``None`` re-reads the environment."""
    global _rules, ARMED
    with _lock:
        _rules = parse(text) if text else None
        ARMED = bool(_rules) if text else bool(os.environ.get(ENV_VAR))


def hit(point: str, **context: Any) -> None:
    """Mark that the code reached ``point``; raise or stall if a rule says so."""
    rules = _plan()
    if not rules:
        return
    delay = 0.0
    with _lock:
        for rule in rules:
            if rule.point != point or not rule.applies(context):
                continue
            rule.seen += 1
            if rule.seen <= rule.skip or (rule.times and rule.fired >= rule.times):
                continue
            rule.fired += 1
            log.warning("injected fault", extra={"point": point, "action": rule.action})
            if rule.action == "raise":
                raise InjectedFaultError(f"injected fault at {point} ({context or 'no context'})")
            delay = max(delay, rule.seconds)
    if delay:
        time.sleep(delay)
