"""Task sources: deterministic by seed, resumable from a saved position without repeats or gaps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from podrl.config import ConfigError
from podrl.config.tasks import TasksConfig
from podrl.tasks import PositionError, build_task_source

REPO_ROOT = Path(__file__).resolve().parents[2]

RG_TASK = {
    "name": "legs",
    "source": {"kind": "reasoning_gym", "dataset": "leg_counting", "chunk_size": 7},
    "template": "Q: {question}\nA:",
    "target_template": "<answer>{answer}</answer>",
    "rewards": [{"name": "reasoning_gym"}],
}


def _tasks(definitions: list[dict[str, Any]], seed: int = 0) -> TasksConfig:
    return TasksConfig.model_validate({"seed": seed, "definitions": definitions})


def test_reasoning_gym_source_is_deterministic_by_seed() -> None:
    first = build_task_source(_tasks([RG_TASK], seed=1)).next_prompts(20)
    second = build_task_source(_tasks([RG_TASK], seed=1)).next_prompts(20)
    other = build_task_source(_tasks([RG_TASK], seed=2)).next_prompts(20)
    assert first == second
    assert [i.prompt for i in first] != [i.prompt for i in other]
    assert [i.id for i in first] == [f"legs/{n}" for n in range(20)]
    item = first[0]
    assert item.prompt.startswith("Q: ") and item.prompt.endswith("\nA:")
    assert item.target == f"<answer>{item.reference}</answer>"
    entry = json.loads(item.metadata["reasoning_gym_entry"])
    assert entry["answer"] == item.reference
    assert item.metadata["reasoning_gym_dataset"] == "leg_counting"
    # The stream crosses chunk borders (chunk_size 7) and does not repeat questions there.
    assert len({i.prompt for i in first}) > 15


def test_reasoning_gym_source_resumes_without_repeats_or_gaps() -> None:
    reference = build_task_source(_tasks([RG_TASK], seed=5)).next_prompts(30)

    source = build_task_source(_tasks([RG_TASK], seed=5))
    before = source.next_prompts(11)
    saved = json.loads(json.dumps(source.position()))  # it survives a JSON round trip
    source.next_prompts(4)  # drawn after the save: lost with the process

    resumed = build_task_source(_tasks([RG_TASK], seed=5))
    resumed.restore(saved)
    after = resumed.next_prompts(19)
    assert before + after == reference
    assert len({i.id for i in before + after}) == 30


def test_reasoning_gym_items_score_right_with_the_reasoning_gym_reward() -> None:
    from podrl.grader.rewards.scoring import reasoning_gym_score

    for item in build_task_source(_tasks([RG_TASK])).next_prompts(5):
        assert reasoning_gym_score(item.target, item.reference, metadata=item.metadata) == 1.0
        wrong = f"<answer>{int(item.reference) + 1}</answer>"
        assert reasoning_gym_score(wrong, item.reference, metadata=item.metadata) < 1.0
        assert reasoning_gym_score("no tags", item.reference, metadata=item.metadata) == 0.0


def test_default_config_builds_a_working_source() -> None:
    items = build_task_source(TasksConfig()).next_prompts(3)
    assert all(i.reference.isdigit() for i in items)
    assert all(i.prompt.startswith("Calculate ") for i in items)


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _jsonl_task(path: Path, **source: Any) -> dict[str, Any]:
    return {
        "name": "qa",
        "source": {
            "kind": "jsonl",
            "path": str(path),
            "prompt_field": "q",
            "answer_field": "a",
            "id_field": "key",
            "metadata_fields": ["topic"],
            **source,
        },
        "template": "[{topic}] {question}",
        "rewards": [{"name": "exact_match"}],
    }


def test_jsonl_source_reads_configured_fields_and_passes_epochs(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    _write_jsonl(path, [{"key": f"k{n}", "q": f"q{n}", "a": n, "topic": "t"} for n in range(5)])
    source = build_task_source(_tasks([_jsonl_task(path, shuffle=False)]))
    items = source.next_prompts(7)
    assert [i.prompt for i in items] == [f"[t] q{n}" for n in (0, 1, 2, 3, 4, 0, 1)]
    assert [i.reference for i in items[:2]] == ["0", "1"]
    assert items[0].metadata == {"topic": "t", "row_id": "k0", "epoch": "0"}
    assert items[5].metadata["epoch"] == "1"


def test_jsonl_shuffle_is_seeded_and_covers_every_row_each_epoch(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    _write_jsonl(path, [{"key": n, "q": f"q{n}", "a": n, "topic": "t"} for n in range(20)])
    items = build_task_source(_tasks([_jsonl_task(path)], seed=3)).next_prompts(40)
    again = build_task_source(_tasks([_jsonl_task(path)], seed=3)).next_prompts(40)
    assert items == again
    epochs = [
        [i.metadata["row_id"] for i in items[:20]],
        [i.metadata["row_id"] for i in items[20:]],
    ]
    assert sorted(epochs[0], key=int) == [str(n) for n in range(20)]
    assert sorted(epochs[1], key=int) == [str(n) for n in range(20)]
    assert epochs[0] != epochs[1]  # each pass has its own order
    assert epochs[0] != [str(n) for n in range(20)]


def test_jsonl_missing_field_names_the_line_and_field(tmp_path: Path) -> None:
    path = tmp_path / "qa.jsonl"
    _write_jsonl(path, [{"key": 1, "q": "x", "a": 1, "topic": "t"}, {"key": 2, "q": "y"}])
    with pytest.raises(
        ConfigError,
        match=r"tasks\.definitions\[0\]\.source: .*qa\.jsonl:2 has no "
        r"field 'a'",
    ):
        build_task_source(_tasks([_jsonl_task(path)]))


def test_jsonl_missing_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tasks\.definitions\[0\]\.source\.path: cannot read"):
        build_task_source(_tasks([_jsonl_task(tmp_path / "absent.jsonl")]))


def test_procedural_tasks() -> None:
    definitions = [
        {
            "name": g,
            "source": {"kind": "procedural", "generator": g},
            "rewards": [{"name": "exact_match"}],
        }
        for g in ("add", "copy", "reverse")
    ]
    source = build_task_source(_tasks(definitions))
    items = source.next_prompts(60)
    assert {i.task for i in items} == {"add", "copy", "reverse"}
    for item in items:
        if item.task == "add":
            a, b = item.prompt.removesuffix("=").split("+")
            assert item.reference == str(int(a) + int(b))
            assert 0 <= int(a) <= 9 and 0 <= int(b) <= 9
        else:
            text = item.prompt.removeprefix(f"{item.task}:").removesuffix("=")
            assert 1 <= len(text) <= 3
            assert item.reference == (text if item.task == "copy" else text[::-1])
        assert item.prompt.isprintable() and item.reference.isprintable()


def test_mul_asks_products_and_its_target_may_use_the_operands() -> None:
    task = {
        "name": "products",
        "source": {"kind": "procedural", "generator": "mul", "min_value": 100, "max_value": 999},
        "target_template": "<calc>{a}*{b}</calc><answer>{answer}</answer>",
        "rewards": [{"name": "exact_match"}],
    }
    for item in build_task_source(_tasks([task])).next_prompts(20):
        a, b = item.prompt.removesuffix("=").split("*")
        assert 100 <= int(a) <= 999 and 100 <= int(b) <= 999
        assert item.reference == str(int(a) * int(b))
        assert item.target == f"<calc>{a}*{b}</calc><answer>{item.reference}</answer>"


def test_mixture_follows_weights_and_resumes() -> None:
    definitions = [
        {
            "name": "a",
            "weight": 3,
            "source": {"kind": "procedural", "generator": "add"},
            "rewards": [{"name": "exact_match"}],
        },
        {
            "name": "b",
            "weight": 1,
            "source": {"kind": "procedural", "generator": "copy"},
            "rewards": [{"name": "exact_match"}],
        },
    ]
    full = build_task_source(_tasks(definitions)).next_prompts(400)
    share = sum(i.task == "a" for i in full) / len(full)
    assert 0.65 < share < 0.85
    source = build_task_source(_tasks(definitions))
    head = source.next_prompts(123)
    resumed = build_task_source(_tasks(definitions))
    resumed.restore(json.loads(json.dumps(source.position())))
    assert head + resumed.next_prompts(277) == full


def test_restore_rejects_a_position_of_another_config() -> None:
    source = build_task_source(_tasks([RG_TASK]))
    with pytest.raises(PositionError, match=r"names tasks \['other'\]"):
        source.restore({"draws": 3, "tasks": {"other": {"index": 3}}})
    with pytest.raises(PositionError, match="draws"):
        source.restore({"tasks": {"legs": {"index": 3}}})
    with pytest.raises(PositionError, match="index"):
        source.restore({"draws": 1, "tasks": {"legs": {"index": -1}}})


def test_jinja_template() -> None:
    task = {
        **RG_TASK,
        "template": "<|user|>{{ question | trim }}{% if task == 'legs' %} (count){% endif %}\n",
        "template_format": "jinja",
    }
    item = build_task_source(_tasks([task])).next_prompts(1)[0]
    assert item.prompt.startswith("<|user|>") and item.prompt.endswith(" (count)\n")


@pytest.mark.parametrize(
    ("template", "template_format", "message"),
    [
        ("{question", "format", r"template is not a valid str\.format template"),
        ("{nope}", "format", r"tasks\.definitions\[0\]\.template: cannot render"),
        ("{{ nope }}", "jinja", r"tasks\.definitions\[0\]\.template: 'nope' is undefined"),
        ("{% if %}", "jinja", r"tasks\.definitions\[0\]\.template: invalid Jinja"),
    ],
)
def test_bad_template_names_the_field(template: str, template_format: str, message: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=message):
        build_task_source(
            _tasks([{**RG_TASK, "template": template, "template_format": template_format}])
        )


def test_unknown_reasoning_gym_dataset_names_the_field() -> None:
    task = {**RG_TASK, "source": {"kind": "reasoning_gym", "dataset": "no_such_dataset"}}
    with pytest.raises(ConfigError, match=r"tasks\.definitions\[0\]\.source\.dataset: unknown"):
        build_task_source(_tasks([task]))


def test_bad_reasoning_gym_params_name_the_field() -> None:
    task = {**RG_TASK, "source": {**RG_TASK["source"], "params": {"no_such_param": 1}}}
    with pytest.raises(ConfigError, match=r"tasks\.definitions\[0\]\.source\.params"):
        build_task_source(_tasks([task]))


def test_tasks_and_grader_import_without_torch_or_vllm() -> None:
    code = (
        "import sys\n"
        "for name in ('torch', 'vllm', 'transformers'):\n"
        "    sys.modules[name] = None  # any import of them now fails\n"
        "from podrl.config import load_config\n"
        "from podrl.tasks import build_task_source\n"
        "import podrl.grader.main\n"
        "print(build_task_source(load_config(env={}).tasks).next_prompts(1)[0].id)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "services")}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "basic_arithmetic/0"
