"""One step of synchronous mode (``loop.mode: sync``, the default): align, draw, generate,
score, batch, Train, samples.jsonl, weight sync, record, one after the other
(docs/controller.md, "One step")."""

from __future__ import annotations

from typing import Any

from podrl.controller.records.run_store import StepRecord
from podrl.controller.step.batch import StepSamples, check_score_errors
from podrl.controller.step.parts import StepParts


class SyncSteps:
    """The :class:`~podrl.controller.step.parts.StepDriver` of synchronous mode."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self._position_before: dict[str, Any] | None = None
        """The task source's position before the attempt running (a failed attempt goes back
        to it: the retry gets the same prompts)."""

    def resumed(self) -> None:
        """Nothing to start: each step draws its own prompts."""

    def checkpoint_position(self) -> dict[str, Any]:
        return self.parts.source.position()

    def failed(self) -> None:
        if self._position_before is not None:
            self.parts.source.restore(self._position_before)  # the same prompts, nothing kept

    def close(self) -> None:
        """Nothing runs between steps."""

    def run_step(self, attempt: int) -> StepRecord | None:
        parts = self.parts
        config = parts.loop_config
        step = parts.state.step + 1
        expected = parts.state.policy_version
        position_before = self._position_before = parts.source.position()
        timings: dict[str, float] = {}
        generating = parts.timed("align", {}, lambda: parts.boundary.align(expected))
        data = StepSamples(items=parts.source.next_prompts(config.prompts_per_step))
        position_after = parts.source.position()
        seed = parts.seed_for(step)
        parts.timed(
            "generate",
            timings,
            lambda: parts.phases.generate(step, data, config.sampling, seed, expected, generating),
        )
        parts.timed("score", timings, lambda: parts.phases.score(data, parts.roster.pods()))
        check_score_errors(data, config.max_score_error_rate)
        batch = parts.build_batch(data)
        trained = parts.train_batch(
            step, attempt, expected, batch, data, position_before, position_after, timings
        )
        parts.recorder.write_samples(step, data, trained.sample_ids)
        sync_seconds = parts.sync_weights(trained.outcome, trained.version, timings)
        return parts.record(step, position_after, data, trained, timings, sync_seconds)
