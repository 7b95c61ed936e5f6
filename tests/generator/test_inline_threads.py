"""The in-process engine core steps with one torch intra-op thread unless OMP_NUM_THREADS is
set (docs/generator.md, "Configuration"). No engine."""

from __future__ import annotations

import pytest
import torch

from podrl.generator.engine_runtime import serve_with_one_intra_op_thread


def test_one_intra_op_thread_unless_omp_num_threads_is_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert serve_with_one_intra_op_thread({}) is True
    assert calls == [1]
    assert serve_with_one_intra_op_thread({"OMP_NUM_THREADS": "4"}) is False
    assert calls == [1]  # the user's count stands
