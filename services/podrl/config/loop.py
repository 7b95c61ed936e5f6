"""Loop section of the run config: the GRPO step the controller drives, synchronous or
asynchronous with bounded staleness (docs/controller.md, "Asynchronous mode")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from podrl.config.base import Section


class SamplingConfig(Section):
    """How the generator samples each prompt's group of completions."""

    n: int = Field(8, ge=2, le=1024, description="Completions per prompt (the GRPO group size).")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=-1, description="Top-k sampling; 0 or -1 disables it.")
    max_tokens: int = Field(32, ge=1, description="Longest completion in tokens.")
    stop: list[str] = Field(default_factory=list, description="Strings that end a completion.")
    seed: int | None = Field(
        None,
        ge=0,
        description="The run's sampling seed: each prompt of each step is sampled with a seed "
        'derived from this one, its step and its prompt id (docs/generator.md, "Reproducible '
        'sampling"), so two runs with the same seed on the same machine write the same '
        "samples, whichever pod generated a prompt and across a resume. None = unseeded: "
        "vLLM's seeded requests sample one request at a time in its sampler, and on GPUs "
        "batched kernels vary with the batch anyway.",
    )


class DriftWarningsConfig(Section):
    """The band the policy-drift figures of a trained step should stay in (docs/algorithms.md,
    "When RL drifts"); a step outside it logs a warning naming the knob to turn, lists it in
    /v1/status ``warnings`` and on the dashboard. The run goes on: a warning stops nothing."""

    mismatch_kl_max: float = Field(
        0.02,
        gt=0,
        description="Largest mismatch_kl (k3 KL of the generator's samples between the "
        "generator and the trainer, per token) before a warning. 0.02 is a typical per-token "
        "log-probability gap of 0.2 nats (the k3 KL is about half its square), where the PPO "
        "ratio against the generator already leaves the 0.2 clip range.",
    )
    update_ratio_min: float = Field(
        1e-8,
        ge=0,
        description="Smallest update_ratio (||theta_after - theta_before|| / ||theta_after||) "
        "before a warning that the policy does not move (0 = never warn).",
    )
    update_ratio_max: float = Field(
        1e-2,
        gt=0,
        description="Largest update_ratio before a warning that one step moved the weights too "
        "far: 1 % of their norm is some 200 times the step of AdamW at the default "
        "trainer.lr 1e-6 on weights of RMS 0.02.",
    )

    @model_validator(mode="after")
    def _check_band(self) -> DriftWarningsConfig:
        if self.update_ratio_min >= self.update_ratio_max:
            raise ValueError(
                f"loop.drift_warnings.update_ratio_min ({self.update_ratio_min:g}) must be below "
                f"loop.drift_warnings.update_ratio_max ({self.update_ratio_max:g}): no step "
                "could be inside the band"
            )
        return self


#: The largest loop.max_staleness: the buffer holds max_staleness + 1 steps of scored groups.
MAX_STALENESS_LIMIT = 64


class LoopConfig(Section):
    """The GRPO loop (docs/controller.md): generate → score → advantages → train →
    publish/apply weights → record; in ``mode: async`` the generate and score phases of later
    steps run while the trainers train."""

    steps: int = Field(
        0,
        ge=0,
        description="Steps to run, each one draw of prompts_per_step prompts. A step counts "
        "whether it trained (the policy version advanced) or not (every group was dropped: no "
        "reward variance, or too few validly scored samples), so the policy version at the end "
        "can be below this number. 0 = no loop (the controller only tracks members).",
    )
    prompts_per_step: int = Field(16, ge=1, description="Prompts drawn per step.")
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: each step generates, scores, trains and syncs in turn (the generators "
        "idle while the trainers train). async: a producer generates and scores the prompts of "
        "the next steps while the trainers train, into a buffer of at most max_staleness + 1 "
        "steps of scored groups; weights reach each pod's generator between its generation "
        'batches (docs/controller.md, "Asynchronous mode").',
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=MAX_STALENESS_LIMIT,
        description="async only: a step trains only groups sampled by policy versions >= the "
        "trainers' version - max_staleness; older groups are dropped and counted "
        "(groups_dropped_stale). The producer runs at most this many steps ahead of the step "
        "being trained. 0 = the synchronous order exactly (same prompts, same versions).",
    )
    weight_apply: Literal["between_batches", "in_flight"] = Field(
        "between_batches",
        description="async only: when a weight sync reaches a pod's generator. "
        "between_batches: between two of the producer's generation batches (each sync waits "
        "for the batch running), so every sample is sampled by one policy version. in_flight: "
        "at once, between two engine steps of the running batch (vLLM's scheduler paused in "
        "keep mode where its engine core runs in a process of its own); samples running then "
        "finish on the new weights, their KV cache recomputed, and record both versions "
        "(policy_version .. last_policy_version in samples.jsonl); staleness is judged by the "
        'oldest (docs/controller.md, "In-flight weight updates").',
    )
    generator_memory: Literal["resident", "sleep_during_train"] = Field(
        "resident",
        description="How a pod's trainer and generator share an accelerator. resident: both "
        "keep their memory (a static split: generator.gpu_memory_utilization or "
        "kv_cache_memory_bytes leaves the rest to the trainer). sleep_during_train: each pod's "
        "generator sleeps (vLLM sleep mode, level 1: weights offloaded to host memory, KV "
        "cache freed) before Train and wakes before the weight sync, so the trainer has the "
        "generator's memory while it trains; sync mode on CUDA only, and "
        'generator.enable_sleep_mode follows it (docs/cuda.md, "One GPU, four services").',
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    drift_warnings: DriftWarningsConfig = Field(default_factory=DriftWarningsConfig)
    normalize_advantages_std: bool = Field(
        True, description="Divide advantages by the group's reward std (GRPO); False = Dr. GRPO."
    )
    keep_equal_reward_groups: bool = Field(
        False,
        description="Send a group whose rewards are all equal to the trainer at advantage 0 "
        "instead of dropping it, as TRL's GRPOTrainer does: it adds no gradient but counts in "
        "the loss's normaliser (sequences or tokens), so a step whose groups are mostly solved "
        "takes a smaller step. False = dropped (DAPO's filter).",
    )
    checkpoint_every: int = Field(
        10, ge=0, description="Save a trainer checkpoint every k steps (0 = only at the end)."
    )
    max_step_attempts: int = Field(
        3,
        ge=1,
        description="A step whose generate or score phase fails (or whose Train fails with the "
        "trainer's version unchanged) is retried from scratch with the same prompts, nothing "
        "half-done kept, this many times; a Train whose outcome is unknown (lost reply, "
        "timeout) is re-sent with the same batch as often; a failed weight sync is retried on "
        "its own as often. Then the run stops as failed.",
    )
    max_score_error_rate: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Largest fraction of a step's samples whose scoring may fail (the reward "
        "raised, timed out, its worker died, unknown task). Failed samples are never trained on; "
        "above this fraction the step attempt fails with the reward's own error message (and is "
        "retried as any failed attempt). A step in which every sample failed scoring always "
        "fails, whatever this value.",
    )
    min_valid_samples_per_group: int = Field(
        2,
        ge=2,
        description="A prompt's group is trained on only if at least this many of its samples "
        "were scored without error (advantages need at least two rewards to compare); otherwise "
        "the whole group is dropped. At most sampling.n.",
    )
    workers_timeout_seconds: float = Field(
        600.0, gt=0, description="How long a step waits for enough healthy worker pods."
    )
    stop_poll_seconds: float = Field(
        0.2,
        gt=0,
        le=10,
        description="async only: how often the producer, and the loop waiting for its "
        "batches, look at the run's stop flag; a stop is noticed within this long.",
    )
    eval_prompts: int = Field(
        0,
        ge=0,
        description="Held-out evaluation: this many prompts of the tasks' evaluation parts "
        "(tasks.definitions[i].split.eval or eval_source), the same ones every time, are "
        "answered greedily (temperature 0, one completion each, loop.sampling.max_tokens and "
        "stop) and scored with the task's rewards, before the first step, every eval_every "
        "steps and at the end. Nothing is trained on them. 0 = no evaluation.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Also evaluate after every k-th step (0 = only before the first step and "
        "at the end).",
    )
    export_at_end: bool = Field(
        True,
        description="When the run finishes, the trainer writes the policy as a Hugging Face "
        "folder to <run_dir>/export (ExportHF); summary.json names it.",
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_sample_seed(cls, data: object) -> object:
        # The field of earlier versions (one seed per step for every prompt): say where it went
        # rather than only that it is unknown.
        if isinstance(data, dict) and "sample_seed" in data:
            raise ValueError(
                "loop.sample_seed is now loop.sampling.seed (each prompt of a step gets a seed of "
                "its own): move the value there"
            )
        return data

    @model_validator(mode="after")
    def _check_staleness_mode(self) -> LoopConfig:
        # Refused only when it differs from the default: a config written out in full (every
        # field, e.g. model_dump) must load again.
        default = type(self).model_fields["max_staleness"].default
        if self.mode == "sync" and self.max_staleness != default:
            raise ValueError(
                f"loop.max_staleness ({self.max_staleness}) is set but loop.mode is sync, which "
                "never trains on stale samples: set loop.mode: async, or remove "
                "loop.max_staleness"
            )
        return self

    @model_validator(mode="after")
    def _check_weight_apply(self) -> LoopConfig:
        if self.mode == "sync" and self.weight_apply == "in_flight":
            raise ValueError(
                "loop.weight_apply is in_flight but loop.mode is sync, whose generators never "
                "sample while weights are synced; set loop.mode: async, or remove "
                "loop.weight_apply"
            )
        return self

    @model_validator(mode="after")
    def _check_generator_memory(self) -> LoopConfig:
        if self.mode == "async" and self.generator_memory == "sleep_during_train":
            raise ValueError(
                "loop.generator_memory is sleep_during_train but loop.mode is async, whose "
                "generators keep sampling while the trainers train; set loop.mode: sync, or "
                "loop.generator_memory: resident"
            )
        return self

    @model_validator(mode="after")
    def _check_group_minimum(self) -> LoopConfig:
        if self.min_valid_samples_per_group > self.sampling.n:
            raise ValueError(
                f"loop.min_valid_samples_per_group ({self.min_valid_samples_per_group}) must be "
                f"at most loop.sampling.n ({self.sampling.n}): no group could ever be trained"
            )
        return self
