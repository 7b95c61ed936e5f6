"""Loop section of the run config: the synchronous GRPO step the controller drives."""

from __future__ import annotations

from pydantic import Field

from podrl.config.base import Section


class SamplingConfig(Section):
    """How the generator samples each prompt's group of completions."""

    n: int = Field(8, ge=2, le=1024, description="Completions per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=-1, description="Top-k sampling; 0 or -1 disables it.")
    max_tokens: int = Field(32, ge=1, description="Longest completion in tokens.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion.")


class LoopConfig(Section):
    """The synchronous GRPO loop (ARCHITECTURE.md §2): generate → score → advantages → train →
    publish/apply weights → record."""

    steps: int = Field(
        0,
        ge=0,
        description="Optimizer steps to run; 0 = no loop (the controller only tracks members).",
    )
    prompts_per_step: int = Field(16, ge=1, description="Prompts drawn per step.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    normalize_advantages_std: bool = Field(
        True, description="Divide advantages by the group's reward std (GRPO); False = Dr. GRPO."
    )
    checkpoint_every: int = Field(
        10, ge=0, description="Save a trainer checkpoint every k steps (0 = only at the end)."
    )
    max_step_attempts: int = Field(
        3,
        ge=1,
        description="A step whose generate or score phase fails (or whose Train fails with the "
        "trainer's version unchanged) is retried from scratch with the same prompts, nothing "
        "half-done kept, this many times; a failed weight sync is retried on its own as often. "
        "Then the run stops as failed.",
    )
    sample_seed: int | None = Field(
        None, description="Base seed for sampling (step s uses seed + s); None = unseeded."
    )
    workers_timeout_seconds: float = Field(
        600.0, gt=0, description="How long a step waits for enough healthy worker pods."
    )
