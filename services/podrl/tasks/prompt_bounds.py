"""Do a run's prompts and completions fit the generator's model length? Checked when the
controller starts (and by ``podrl run``/``podrl up`` before they start anything), not when a
config loads: bounding a task's longest prompt renders it through the task's template, and
loading a config must not depend on the task code.

Every task's longest prompt plus ``loop.sampling.max_tokens`` must fit in
``generator.max_model_len``: vLLM silently stops a completion at the model length, below its
budget. The load-time rule in :mod:`podrl.config.coupling` already refuses a budget that leaves
no room for even one prompt token; this check adds what only the rendered prompts can tell.
"""

from __future__ import annotations

from podrl.config import ConfigError, RunConfig
from podrl.config.tasks import ProceduralSourceConfig, TaskConfig
from podrl.tasks.procedural import ProceduralRecords
from podrl.tasks.task_stream import TaskStream, TemplateError

PROMPT_SPECIAL_TOKENS = 4
"""Tokens a tokenizer may add to a prompt besides its text (BOS, a SentencePiece word prefix)."""


def max_prompt_tokens(task: TaskConfig) -> int | None:
    """An upper bound on the tokens of ``task``'s longest prompt, or None when its prompts are
    not known before they are drawn (reasoning-gym and JSON-lines sources).

    For procedural sources the longest prompt is rendered through the task's own template
    (operands at ``max_value``, strings of ``max_length`` of the alphabet's widest character).
    Its UTF-8 bytes bound its tokens for byte-level BPE and character tokenizers (no token is
    shorter than one byte), plus :data:`PROMPT_SPECIAL_TOKENS` for markers a tokenizer adds.
    """
    source = task.source
    if not isinstance(source, ProceduralSourceConfig):
        return None
    widest = max(source.alphabet, key=lambda char: len(char.encode()))
    longest = source.model_copy(
        update={"min_value": source.max_value, "min_length": source.max_length, "alphabet": widest}
    )
    try:
        prompt = TaskStream(task, ProceduralRecords(longest, 0), "tasks").item(0).prompt
    except (TemplateError, ImportError):
        # A template that cannot render is reported by the task source with its field; a Jinja
        # template needs jinja2, which only the controller's image must have.
        return None
    return len(prompt.encode()) + PROMPT_SPECIAL_TOKENS


def check_prompts_fit(config: RunConfig) -> None:
    """Raise ConfigError naming ``loop.sampling.max_tokens`` and ``generator.max_model_len``
    (and the task) when a task's longest prompt plus the completion budget exceeds the model
    length; every offending task is reported at once."""
    budget, limit = config.loop.sampling.max_tokens, config.generator.max_model_len
    problems = []
    for index, task in enumerate(config.tasks.definitions):
        prompt = max_prompt_tokens(task)
        if prompt is None or prompt + budget <= limit:
            continue
        problems.append(
            f"loop.sampling.max_tokens / generator.max_model_len: the longest prompt of task "
            f"{task.name!r} (tasks.definitions[{index}]) takes up to {prompt} tokens, and with "
            f"loop.sampling.max_tokens ({budget}) that exceeds generator.max_model_len "
            f"({limit}): completions would stop short of their budget; raise "
            f"generator.max_model_len to at least {prompt + budget} (within the model's context "
            "length) or lower loop.sampling.max_tokens"
        )
    if problems:
        raise ConfigError("; ".join(problems))
