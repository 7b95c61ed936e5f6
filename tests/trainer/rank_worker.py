"""Scenarios run inside trainer ranks spawned by the tests (one process per rank, gloo)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from podrl.common.processes import free_port
from podrl.v1 import trainer_pb2


def make_request(seed: int, sequences: int = 6, version: int = 0) -> trainer_pb2.TrainRequest:
    """A deterministic batch: random prompts/completions of varied lengths, plausible logprobs."""
    gen = torch.Generator().manual_seed(seed)
    out = trainer_pb2.TrainRequest(policy_version=version)
    for i in range(sequences):
        prompt = torch.randint(
            3, 120, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen
        )
        completion = torch.randint(
            3, 120, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen
        )
        logprobs = -4.85 + 0.3 * torch.randn(len(completion), generator=gen)
        out.sequences.add(
            sample_id=f"s{seed}-{i}",
            prompt_ids=prompt.tolist(),
            completion_ids=completion.tolist(),
            generator_logprobs=logprobs.clamp(max=-0.01).tolist(),
            advantage=float(torch.randn(1, generator=gen)),
            policy_version=version,
        )
    return out


def config_env(model_dir: str, run_dir: str, **trainer: object) -> dict[str, str]:
    env = {
        "PODRL_DEVICE": "cpu",
        "PODRL_RUN_DIR": run_dir,
        "PODRL_TRAINER__MODEL_PATH": model_dir,
        "PODRL_TRAINER__LR": "1e-3",
        "PODRL_TRAINER__MICRO_BATCH_SIZE": "2",
    }
    env.update({f"PODRL_TRAINER__{k.upper()}": str(v) for k, v in trainer.items()})
    return env


@torch.no_grad()
def policy_logits(engine, input_ids: torch.Tensor) -> torch.Tensor:
    """Full logits of the engine's policy for ``input_ids`` [B, L] (a collective: every rank
    calls it)."""
    engine.model.eval()
    out = engine.model(input_ids=input_ids.to(engine.device)).logits.float()
    engine.model.train()
    return out


def _engine(env: dict[str, str]):
    from podrl.config import load_config
    from podrl.trainer.engine import TrainerEngine

    return TrainerEngine.build(load_config(None, {**os.environ, **env}))


def _metrics(reply: trainer_pb2.TrainResponse) -> dict[str, float]:
    m = reply.metrics
    return {
        "loss": m.loss,
        "pg_loss": m.pg_loss,
        "kl": m.kl,
        "entropy": m.entropy,
        "ratio_mean": m.ratio_mean,
        "clip_fraction": m.clip_fraction,
        "grad_norm": m.grad_norm,
        "logprob_diff_mean": m.logprob_diff_mean,
        "logprob_diff_max": m.logprob_diff_max,
        "tokens": m.tokens,
        "clip_fraction_low": m.clip_fraction_low,
        "clip_fraction_high": m.clip_fraction_high,
        "clip_fraction_dual": m.clip_fraction_dual,
        "ratio_min": m.ratio_min,
        "ratio_max": m.ratio_max,
        "is_weight_mean": m.is_weight_mean,
        "is_weight_min": m.is_weight_min,
        "is_weight_max": m.is_weight_max,
        "is_masked_fraction": m.is_masked_fraction,
        "mismatch_kl": m.mismatch_kl,
        "update_ratio": m.update_ratio,
    }


def shard_digest(engine) -> str:
    """sha256 of this rank's local parameter shards (names, shapes and bytes), bit for bit."""
    digest = hashlib.sha256()
    for name, param in engine.model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        digest.update(f"{name}{tuple(local.shape)}".encode())
        digest.update(local.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def rank_output(out: str, rank: int) -> Path:
    """Where rank ``rank`` writes its results: ``out`` for rank 0, ``out.rank<r>`` else."""
    return Path(out) if rank == 0 else Path(f"{out}.rank{rank}")


def scenario(
    rank: int, world: int, port: int, env: dict[str, str], plan: list[list], out: str
) -> None:
    """Run ``plan`` (a list of ["train", seed] | ["try_train", seed] | ["save", dir, blob] |
    ["try_save", dir, blob] | ["load", dir] | ["export", dir] | ["logits", seed] |
    ["state"] | ["faults", plan_json]) on this rank; every rank writes its results to
    ``rank_output(out, rank)``.

    ``try_*`` record ``{"error": ...}`` instead of failing the rank; ``state`` records this
    rank's step, version and ``shard_digest``; ``faults`` replaces the process's fault plan
    (``podrl.common.faults``)."""
    from podrl.common import faults

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    engine = _engine(env)
    results: list[object] = []
    try:
        for step in plan:
            kind = step[0]
            if kind == "train":
                request = make_request(step[1], version=engine.policy_version)
                results.append(_metrics(engine.train_step(request)))
            elif kind == "try_train":
                request = make_request(step[1], version=engine.policy_version)
                try:
                    results.append(_metrics(engine.train_step(request)))
                except Exception as err:
                    results.append({"error": f"{type(err).__name__}: {err}"})
            elif kind == "state":
                results.append({"version": engine.policy_version, "digest": shard_digest(engine)})
            elif kind == "faults":
                faults.reset(step[1])
                results.append(None)
            elif kind == "save":
                engine.save_checkpoint(Path(step[1]), step[2].encode())
                results.append(None)
            elif kind == "try_save":
                try:
                    engine.save_checkpoint(Path(step[1]), step[2].encode())
                    results.append(None)
                except Exception as err:
                    results.append({"error": f"{type(err).__name__}: {err}"})
            elif kind == "to_previous_format":  # the state file as format 1 wrote it
                state_file = Path(step[1]) / "trainer_state.json"
                saved = json.loads(state_file.read_text())
                train_state = saved.pop("train_state")
                saved.update(train_state, format=1, step=train_state["policy_version"])
                state_file.write_text(json.dumps(saved))
                results.append(None)
            elif kind == "load":
                blob = engine.load_checkpoint(Path(step[1]))
                results.append({"blob": blob.decode(), "version": engine.policy_version})
            elif kind == "export":
                results.append(engine.export_hf(Path(step[1])))
            elif kind == "logits":
                ids = torch.tensor([s.prompt_ids for s in make_request(step[1]).sequences[:1]])
                logits = policy_logits(engine, ids)
                torch.save(logits.cpu(), step[2]) if rank == 0 else None
                results.append(None)
        rank_output(out, rank).write_text(json.dumps(results))
    finally:
        engine.close()


def run_ranks(world: int, env: dict[str, str], plan: list[list], out: Path) -> list:
    """Run ``scenario`` on ``world`` spawned gloo ranks; rank 0's results."""
    return run_ranks_each(world, env, plan, out)[0]


def run_ranks_each(world: int, env: dict[str, str], plan: list[list], out: Path) -> list[list]:
    """Run ``scenario`` on ``world`` spawned gloo ranks; every rank's results, by rank."""
    mp.start_processes(
        scenario,
        args=(world, free_port(), env, plan, str(out)),
        nprocs=world,
        join=True,
        start_method="spawn",
    )
    return [json.loads(rank_output(str(out), rank).read_text()) for rank in range(world)]
