"""The environment service: multi-turn episodes in which the model calls a tool or acts in an
environment and reads its reply (docs/environments.md)."""

from podrl.environments.base import Environment, StepResult

__all__ = ["Environment", "StepResult"]
