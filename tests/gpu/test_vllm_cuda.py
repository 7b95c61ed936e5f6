"""vLLM's CUDA build with podrl's services on one GPU (docs/cuda.md, "vLLM on the H200").

The real trainer service (FSDP2 on one GPU, fp32 master weights) publishes CUDA IPC manifests;
the real generator service applies them with its vLLM worker extension, ``in_place``, into
vLLM's own parameters. The run itself is bench/vllm_cuda.py (one engine start for every check);
these tests assert on what it saw. Set ``BENCH_VLLM_OUT=FILE`` to also take the
measurements and write them to FILE (the device run of docs/cuda.md does).

Skipped without CUDA (tests/gpu/conftest.py) and without vLLM.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from bench.vllm_cuda import SWAPPED_TARGET, Options, Results, run
from podrl.generator.vllm_compat import SUPPORTED_VLLM

VERSIONS = ("v1", "v2", "v3", "after_rollback", "after_sleep1", "after_sleep2")


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> Results:
    out = os.environ.get("BENCH_VLLM_OUT")
    opts = Options(
        device="cuda",
        shape=os.environ.get("BENCH_VLLM_SHAPE", "0.6b"),
        measure=bool(out),
        out=Path(out) if out else None,
        work_dir=tmp_path_factory.mktemp("vllm-cuda"),
        budget_seconds=float(os.environ.get("BENCH_VLLM_BUDGET", "480")),
    )
    results = run(opts)
    assert not [e for e in results.errors if not e.startswith("sync 1.7b")], results.errors
    return results


def test_the_engine_is_vllm_cuda_with_weights_applied_in_place(vllm_run: Results) -> None:
    facts = vllm_run.facts
    assert facts["info_device"] == "cuda"
    assert facts["info_details"]["vllm_version"] in SUPPORTED_VLLM
    assert facts["info_details"]["weight_apply_mode"] == "in_place"
    # auto would pick in_place too: no parameter was repacked after loading.
    assert facts["describe_auto"]["apply_mode"] == "in_place"
    assert facts["describe_auto"]["repacked"] == []


def test_every_vllm_parameter_equals_the_trainers_full_tensor_cast_to_bf16(
    vllm_run: Results,
) -> None:
    checks = vllm_run.checks
    for version in VERSIONS:
        if f"compare_{version}" not in checks:
            continue  # sleep-mode checks run only where vLLM has sleep mode
        compared = checks[f"compare_{version}"]
        assert compared["mismatched"] == [], version
        assert compared["unreadable"] == [] and compared["not_in_vllm"] == [], version
        assert compared["compared"] == compared["parameters"] > 0, version
        assert compared["dtypes"] == ["torch.bfloat16"], version
    assert {"compare_v1", "compare_v2", "compare_after_sleep2"} <= set(checks)
    assert all(checks[f"compare_{v}"]["not_expected"] == [] for v in ("v1", "v2"))
    # The comparison can fail: two steps at lr 1e-3 moved every matrix away from the folder's
    # values, also after the bf16 cast (norm weights near 1.0 may round back to it).
    moved = checks["v2_vs_initial_folder"]["mismatched"]
    matrices = [n for n in checks["v2_vs_initial_folder"]["names"] if n.endswith("proj.weight")]
    assert matrices and set(matrices) <= set(moved)
    assert "model.embed_tokens.weight" in moved


def test_the_first_sync_is_full_and_later_ones_reuse_the_plan(vllm_run: Results) -> None:
    checks = vllm_run.checks
    assert not checks["sync_v1"]["version_only"] and not checks["sync_v1"]["plan_cached"]
    assert checks["sync_v2"]["version_only"] and checks["sync_v2"]["plan_cached"]


def test_weights_are_written_into_vllms_own_storage(vllm_run: Results) -> None:
    assert vllm_run.checks["pointers_unchanged_after_apply"] is True
    assert vllm_run.checks["pointers_unchanged_after_sleep"] is True


def test_a_permuted_shard_is_caught_by_the_comparison(vllm_run: Results) -> None:
    checks = vllm_run.checks
    # Swapped after signing: the weights key's MAC refuses it before anything is written...
    assert checks["permuted_unsigned_apply"] == "PERMISSION_DENIED"
    # ...signed (a trainer with a layout bug): applied, and the element-wise comparison sees
    # exactly the fused tensor the two shards land in.
    assert checks["compare_permuted"]["mismatched"] == [SWAPPED_TARGET]
    # ...and the trainer's weights come back with a rollback's full manifest.
    assert checks["compare_after_rollback"]["mismatched"] == []


def test_generator_logprobs_match_the_trainers_unless_the_layout_is_wrong(
    vllm_run: Results,
) -> None:
    correct = vllm_run.checks["logprob_diff_correct"]
    permuted = vllm_run.checks["logprob_diff_permuted"]
    print(f"|trainer - generator| logprob: correct {correct}, permuted shard {permuted}")
    assert correct["tokens"] > 0
    # bf16 kernels differ (vLLM's attention vs the trainer's), a wrong layout differs more.
    assert correct["mean"] < 0.05
    assert permuted["mean"] > 4 * correct["mean"]


def test_a_too_long_prompt_is_invalid_argument(vllm_run: Results) -> None:
    """vLLM 0.26 has no VLLMClientError: the old import answered UNKNOWN (ImportError)."""
    assert vllm_run.checks["too_long_prompt"] == "INVALID_ARGUMENT"


def test_level_2_sleep_needs_a_full_manifest_and_gets_the_trainers_weights(
    vllm_run: Results,
) -> None:
    checks = vllm_run.checks
    assert checks["after_sleep2_weight_state"] == "needs_full"
    assert checks["generate_after_sleep2"] == "FAILED_PRECONDITION"
    assert not checks["sync_after_sleep2"]["version_only"]
    assert checks["after_full_weight_state"] == "idle"
    assert checks["compare_after_sleep2"]["mismatched"] == []
