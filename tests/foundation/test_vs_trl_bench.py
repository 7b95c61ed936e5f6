"""bench/vs_trl_gpu.py's pure parts (docs/cuda.md, "A GPU run that learns"): its arguments, the
runs it configures for each system, the prompts and settings TRL gets, its JSON rows, and the one
held-out evaluation every system's final model goes through. The runs themselves need the GPU
machine (CI has none)."""

from __future__ import annotations

import json
import sqlite3
import sys
import types
from pathlib import Path

import pytest
import yaml

from bench import vs_trl_gpu
from podrl.config import RunConfig, load_config
from podrl.controller.records.evaluation import distinct_prompts
from podrl.models.tiny import make_tiny_model
from podrl.tasks import build_task_source


def _recipe(**changes: object) -> dict[str, object]:
    opts = vs_trl_gpu.Options(device="cpu", **changes)  # type: ignore[arg-type]
    return vs_trl_gpu.recipe(opts)


def test_the_arguments_name_systems_seeds_and_recipe_overrides() -> None:
    opts = vs_trl_gpu.parse_args(
        ["--systems", "podrl-sync,trl", "--seeds", "3,4", "--lr", "2e-5",
         "--set", "trainer.clip_eps_high=0.28", "--set", "loop.sampling.n=4"]
    )  # fmt: skip
    assert opts.systems == ("podrl-sync", "trl") and opts.seeds == (3, 4)
    assert opts.extra == {"trainer.clip_eps_high": 0.28, "loop.sampling.n": 4}
    config = vs_trl_gpu.recipe(opts)
    assert config["trainer"]["lr"] == 2e-5 and config["trainer"]["clip_eps_high"] == 0.28
    assert config["loop"]["sampling"]["n"] == 4
    defaults = vs_trl_gpu.parse_args([])
    assert defaults.systems == tuple(vs_trl_gpu.SYSTEMS) and defaults.seeds == (0, 1, 2)


@pytest.mark.parametrize(
    "argv",
    [["--systems", "podrl-sync,verl"], ["--seeds", "0,x"], ["--set", "trainer.lr"],
     ["--concurrency", "0"]],
)  # fmt: skip
def test_bad_arguments_are_refused_by_name(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        vs_trl_gpu.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_each_podrl_system_is_the_recipe_with_only_its_loop_mode_changed(tmp_path: Path) -> None:
    base = _recipe()
    loaded = {}
    for system in ("podrl-sync", "podrl-async", "podrl-in-flight"):
        config = vs_trl_gpu.podrl_config(base, system, 7, tmp_path / "warm", tmp_path / system)
        path = tmp_path / f"{system}.yaml"
        path.write_text(yaml.safe_dump(config))
        loaded[system] = load_config(path, env={})
    sync, asyn, in_flight = loaded.values()
    assert (sync.loop.mode, asyn.loop.mode, in_flight.loop.mode) == ("sync", "async", "async")
    assert (asyn.loop.weight_apply, in_flight.loop.weight_apply) == (
        "between_batches",
        "in_flight",
    )
    for run in loaded.values():
        assert run.loop.sampling.seed == 7 and run.trainer.seed == 7
        assert run.loop.export_at_end  # the shared evaluation reads the exported model
        assert run.loop.keep_equal_reward_groups  # as TRL trains solved groups
        assert run.tasks == sync.tasks and run.loop.sampling == sync.loop.sampling
        assert run.trainer.lr == sync.trainer.lr
        assert run.trainer.warmup_steps == sync.trainer.warmup_steps
    assert base["loop"]["sampling"]["temperature"] == sync.loop.sampling.temperature


def test_trl_gets_podrls_prompts_in_order_and_its_settings(tmp_path: Path) -> None:
    config = _recipe(steps=3)
    prompts = vs_trl_gpu.training_prompts(config)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    source = build_task_source(load_config(path, env={}).tasks)
    expected = [item.prompt for _ in range(3) for item in source.next_prompts(16)]
    assert [p["prompt"] for p in prompts] == expected
    settings = vs_trl_gpu.trl_settings(config, 5, vs_trl_gpu.Options())
    trainer, sampling = config["trainer"], config["loop"]["sampling"]
    assert settings["learning_rate"] == trainer["lr"]
    assert settings["warmup_steps"] == trainer["warmup_steps"]
    assert trainer["lr_schedule"] == "linear" and settings["lr_scheduler_type"] == "linear"
    assert settings["loss_type"] == trainer["loss_mode"]
    assert settings["per_device_train_batch_size"] == 16 * sampling["n"]  # one step per batch
    assert settings["num_generations"] == sampling["n"]
    assert settings["temperature"] == sampling["temperature"]
    assert settings["max_completion_length"] == sampling["max_tokens"]
    assert settings["generation_kwargs"] == {"stop": sampling["stop"]}
    assert not settings["shuffle_dataset"] and settings["seed"] == 5 and settings["max_steps"] == 3
    assert settings["use_vllm"] and settings["vllm_mode"] == "colocate"


def test_a_row_has_the_bench_figures_of_a_run() -> None:
    row = vs_trl_gpu.row(
        "podrl-async",
        1,
        rewards=[0.1] * 5 + [0.5] * 5 + [0.9] * 10,
        step_ends=[100.0, 100.5, 101.0, 101.5, 102.0],
        samples_per_step=128,
        heldout_before=0.3,
        heldout_after=0.6,
        drift={"mismatch_kl": [0.001, 0.003], "update_ratio": [1e-3, None, 3e-3]},
        exit_code=0,
    )
    assert list(row)[: len(vs_trl_gpu.ROW_KEYS)] == list(vs_trl_gpu.ROW_KEYS)
    assert row["mode"] == "async" and row["seed"] == 1
    assert row["s_per_step"] == 0.5 and row["samples_per_s"] == 256.0
    assert row["reward_first5"] == 0.1 and row["reward_last10"] == 0.9
    assert row["mismatch_kl_mean"] == 0.002 and row["mismatch_kl_max"] == 0.003
    assert row["update_ratio_mean"] == 0.002 and row["exit_code"] == 0
    trl = vs_trl_gpu.row(
        "trl", 0, rewards=[], step_ends=[1.0], samples_per_step=128,
        heldout_before=0.3, heldout_after=None,
    )  # fmt: skip
    assert trl["s_per_step"] is None and trl["mismatch_kl_mean"] is None
    summary = vs_trl_gpu.summarise([row, {**row, "seed": 2, "heldout_after": 0.4}, trl])
    assert summary["podrl-async"]["heldout_gain"] == 0.2
    assert summary["podrl-async"]["seeds_gaining_0.2"] == 1
    assert summary["trl"]["runs"] == 0


def test_the_reward_is_the_tasks_reward_plan_and_passing_its_threshold() -> None:
    score = vs_trl_gpu.reward_scorer(_recipe())
    assert score("copy", "copy:abc=", "abc", "abc") == (1.0, True)
    reward, passed = score("copy", "copy:abc=", "abd\nxyz", "abc")
    assert reward == pytest.approx(0.5 * 2 / 3) and not passed


def test_the_evaluation_asks_podrls_held_out_prompts(tmp_path: Path) -> None:
    config = _recipe(eval_prompts=12)
    items = vs_trl_gpu.eval_items(config)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    held_out = distinct_prompts(load_config(path, env={}).tasks, 12)
    assert [i["prompt"] for i in items] == [i.prompt for i in held_out]


def test_the_evaluation_answers_greedily_in_batches_as_one_prompt_at_a_time(
    tmp_path: Path,
) -> None:
    model = make_tiny_model(tmp_path / "tiny")
    score = vs_trl_gpu.reward_scorer(_recipe())
    # Prompts of different lengths: a batch pads them, which must not change an answer.
    items = [
        {"prompt": f"copy:{text}=", "reference": text, "task": "copy"}
        for text in ("ab", "cdef", "g", "hijklm", "nop", "abcdefgh")
    ]
    kwargs = {"max_tokens": 6, "stop": "\n", "device": "cpu"}
    batched = vs_trl_gpu.evaluate(model, items, score, batch_size=4, **kwargs)
    one = [vs_trl_gpu.evaluate(model, [i], score, **kwargs)["completions"][0] for i in items]
    assert batched["completions"] == one
    scored = [
        score(i["task"], i["prompt"], c, i["reference"]) for i, c in zip(items, one, strict=True)
    ]
    assert batched["accuracy"] == round(sum(p for _, p in scored) / len(items), 4)
    assert batched["reward_mean"] == pytest.approx(sum(r for r, _ in scored) / len(items), abs=1e-4)


def test_the_readmes_gpu_figures_are_the_measured_ones() -> None:
    """README states the committed H200 run: held-out before, and the range after over every
    podrl run (sync, async, in flight; 3 seeds each)."""
    root = Path(__file__).resolve().parents[2]
    rows = json.loads((root / "bench/results/vs_trl_gpu_h200.json").read_text())["rows"]
    podrl = [row for row in rows if row["system"].startswith("podrl")]
    before = {round(row["heldout_before"], 2) for row in podrl}
    after = [row["heldout_after"] for row in podrl]
    assert len(podrl) == 9 and len(before) == 1
    claim = (
        f"raised the held-out accuracy from {before.pop():.2f} to "
        f"{min(after):.2f}\u2013{max(after):.2f} in sync and async mode"
    )
    readme = " ".join((root / "README.md").read_text().split())
    assert claim in readme, claim


def test_each_trl_run_seeds_its_colocated_vllm_engine_with_the_runs_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL 1.16 builds its colocated engine with seed = process index // TP whatever
    GRPOConfig.seed is, so runs of different seeds sampled alike: the TRL worker (with fakes of
    TRL and datasets, which CI lacks) must hand the run's seed to the engine TRL builds."""
    built: list[dict[str, object]] = []

    def llm(**kwargs: object) -> None:  # vLLM's LLM as TRL's module names it
        built.append(kwargs)

    vllm_generation = types.SimpleNamespace(LLM=llm)

    class GRPOTrainer:  # builds its engine as TRL 1.16 does (process 0, TP 1), trains nothing
        def __init__(self, args: types.SimpleNamespace, **_: object) -> None:
            vllm_generation.LLM(model="m", seed=0 // 1, gpu_memory_utilization=0.05)
            self.state = types.SimpleNamespace(log_history=[])

        def train(self) -> None: ...

        def save_model(self, path: str) -> None: ...

    trl = types.ModuleType("trl")
    trl.GRPOConfig = types.SimpleNamespace  # type: ignore[attr-defined]
    trl.GRPOTrainer = GRPOTrainer  # type: ignore[attr-defined]
    datasets = types.ModuleType("datasets")
    datasets.Dataset = types.SimpleNamespace(from_list=list)  # type: ignore[attr-defined]
    generation = types.ModuleType("trl.generation")
    generation.vllm_generation = vllm_generation  # type: ignore[attr-defined]
    for name, module in (("trl", trl), ("trl.generation", generation), ("datasets", datasets)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "trl.generation.vllm_generation", vllm_generation)
    config = _recipe(steps=1)
    for seed in (1, 2):
        settings = vs_trl_gpu.trl_settings(config, seed, vs_trl_gpu.Options())
        spec = tmp_path / f"spec-{seed}.json"
        spec.write_text(json.dumps({
            "config": config, "model": "m", "output_dir": str(tmp_path), "prompts": [],
            "result": str(tmp_path / "result.json"), "settings": settings,
            "kv_cache_bytes": 1 << 29,
        }))  # fmt: skip
        vllm_generation.LLM = llm
        assert vs_trl_gpu.trl_worker(spec) == 0
    assert [b["seed"] for b in built] == [1, 2]
    assert all(b["kv_cache_memory_bytes"] == 1 << 29 for b in built)


def test_the_ranks_of_a_tp_group_keep_one_engine_seed() -> None:
    built: list[object] = []
    module = types.SimpleNamespace(LLM=lambda **kwargs: built.append(kwargs["seed"]))
    vs_trl_gpu.colocated_engine(module, seed=5)
    for tp_group in (0, 0, 1):  # TRL's process_index // tensor_parallel_size
        module.LLM(seed=tp_group)
    assert built == [5, 5, 6]


def test_a_podrl_run_gives_the_figures_trls_steps_are_compared_with(tmp_path: Path) -> None:
    """Gradient norm, last learning rate and the share of groups dropped for equal rewards
    (not those dropped for score errors or staleness), from the run's step records."""
    steps = [
        {"reward_mean": 0.5, "update_ratio": 1e-4, "grad_norm": 0.4, "learning_rate": 1e-5,
         "groups": 16, "groups_dropped": 6, "groups_dropped_stale": 2},
        {"reward_mean": 0.9, "update_ratio": 2e-4, "grad_norm": 0.2, "learning_rate": 5e-6,
         "groups": 16, "groups_dropped": 12, "groups_dropped_score_errors": 4},
    ]  # fmt: skip
    with sqlite3.connect(tmp_path / "controller.sqlite") as db:
        db.execute("CREATE TABLE steps (step INTEGER, metrics TEXT, finished_at REAL)")
        for i, metrics in enumerate(steps):
            db.execute("INSERT INTO steps VALUES (?, ?, ?)", (i, json.dumps(metrics), 10.0 + i))
    (tmp_path / "summary.json").write_text(json.dumps({"phase": "finished"}))
    figures = vs_trl_gpu.read_podrl_run(tmp_path)
    assert figures["zero_std_fraction"] == [0.25, 0.5]
    steps[0]["groups_equal_reward"] = 8  # recorded: counted whether dropped or kept
    with sqlite3.connect(tmp_path / "controller.sqlite") as db:
        db.execute("UPDATE steps SET metrics = ? WHERE step = 0", (json.dumps(steps[0]),))
    assert vs_trl_gpu.read_podrl_run(tmp_path)["zero_std_fraction"] == [0.5, 0.5]
    assert figures["drift"]["grad_norm"] == [0.4, 0.2] and figures["lr_last"] == 5e-6


def test_trls_lr_schedule_is_the_recipes_and_a_decay_that_does_not_end_at_0_is_refused() -> None:
    config = _recipe(steps=50)
    loaded = RunConfig.model_validate(config).trainer
    assert (loaded.lr_schedule, loaded.total_steps, loaded.min_lr_ratio) == ("linear", 50, 0.0)
    assert loaded.warmup_steps == 5  # the recipe's 10 of 100 steps, scaled with --steps
    for schedule, trl in (("constant", "constant_with_warmup"), ("cosine", "cosine")):
        config["trainer"]["lr_schedule"] = schedule
        assert vs_trl_gpu.trl_lr_schedule(config) == trl
    for field, value in (("min_lr_ratio", 0.1), ("total_steps", 80)):
        changed = {**config, "trainer": {**config["trainer"], field: value}}
        with pytest.raises(ValueError, match=f"trainer.{field}"):
            vs_trl_gpu.trl_lr_schedule(changed)


def test_docs_table_and_readme_figures_are_rendered_from_the_committed_json(
    tmp_path: Path,
) -> None:
    """docs/cuda.md's table is `python -m bench.vs_trl_gpu --docs` of the committed JSON; a
    figure edited by hand, or a JSON without its table rendered again, fails here."""
    docs, readme = tmp_path / "cuda.md", tmp_path / "README.md"
    docs.write_text(vs_trl_gpu.DOCS.read_text())
    readme.write_text(vs_trl_gpu.README.read_text())
    vs_trl_gpu.render_docs(vs_trl_gpu.RESULT, docs, readme)
    assert docs.read_text() == vs_trl_gpu.DOCS.read_text()
    assert readme.read_text() == vs_trl_gpu.README.read_text()
    results = json.loads(vs_trl_gpu.RESULT.read_text())
    next(r for r in results["rows"] if r["system"] == "podrl-sync")["heldout_after"] = 0.5
    # A run that failed has a row of its error alone: rendered as dashes.
    results["rows"].insert(0, {"system": "podrl-async", "mode": "async", "seed": 3, "error": "x"})
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(results))
    vs_trl_gpu.render_docs(changed, docs, readme)
    assert "**0.500**" in docs.read_text()
    assert "| podrl async (`max_staleness: 1`) | 3 | — → **—** |" in docs.read_text()
    assert "from 0.11 to 0.50\u2013" in " ".join(readme.read_text().split())


def test_the_late_reward_swings_docs_cuda_states_are_the_committed_runs() -> None:
    """docs/cuda.md, "TRL's defaults against podrl's recipe": the training reward of the last 20
    steps, lowest and highest over podrl's runs and over TRL's."""
    rows = json.loads(vs_trl_gpu.RESULT.read_text())["rows"]
    late = {
        name: [
            r for row in rows if row["system"].startswith(name) for r in row["reward_curve"][-20:]
        ]
        for name in ("podrl", "trl")
    }
    claim = (
        f"podrl's last 20 steps swing between {min(late['podrl']):.2f} and "
        f"{max(late['podrl']):.2f}, TRL's between {min(late['trl']):.2f} and {max(late['trl']):.2f}"
    )
    assert claim in " ".join(vs_trl_gpu.DOCS.read_text().split()), claim
