"""Task sources: deterministic, resumable prompt streams (imports neither torch nor vLLM).

source = build_task_source(run_config.tasks)
items = source.next_prompts(8)          # list[PromptItem]
saved = source.position()               # JSON-serialisable dict
source.restore(saved)                   # continue exactly there
"""

from podrl.tasks.factory import build_task_source
from podrl.tasks.task_stream import (
    PositionError,
    PromptItem,
    PromptTemplate,
    TaskMixture,
    TaskSource,
    TemplateError,
)

__all__ = [
    "PositionError",
    "PromptItem",
    "PromptTemplate",
    "TaskMixture",
    "TaskSource",
    "TemplateError",
    "build_task_source",
]
