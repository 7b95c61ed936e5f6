"""The benches' one way to run ``podrl run`` and ``podrl warm-start`` (bench/run_env.py, used
by bench/cuda_grpo.py and bench/vs_trl_gpu.py): a run's output goes to the log, it answers the
exit code, or how long it ran when it was killed at its timeout; a warm-start answers its
process with the output captured."""

from __future__ import annotations

from pathlib import Path

from bench.run_env import podrl_run, podrl_warm_start


def test_a_run_answers_its_exit_code_and_logs_its_output(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    code = podrl_run(tmp_path / "missing.yaml", log, timeout=120)
    assert code == 2, log.read_text()  # a config that cannot be read: exit 2, naming it
    assert "missing.yaml" in log.read_text()


def test_a_run_past_its_timeout_says_so(tmp_path: Path) -> None:
    assert podrl_run(tmp_path / "missing.yaml", tmp_path / "run.log", timeout=0.01) == (
        "timed out after 0 s"
    )


def test_a_warm_start_answers_its_process_with_the_output_captured(tmp_path: Path) -> None:
    done = podrl_warm_start(tmp_path / "missing.yaml", tmp_path / "base", tmp_path / "out", 2, 1e-5)
    assert done.returncode == 2
    assert "missing.yaml" in done.stdout + done.stderr
