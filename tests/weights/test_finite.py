"""The finiteness check the trainer runs before it publishes and the receiver before it copies
(services/podrl/weights/protocol.py)."""

from __future__ import annotations

import pytest
import torch

from podrl.weights.protocol import FiniteCheck, first_non_finite


def _tensors() -> list[tuple[str, torch.Tensor]]:
    return [
        ("a", torch.randn(8, 4)),
        ("b", torch.randn(16)),
        ("c", torch.randn(4, 4).to(torch.bfloat16)),
        ("ids", torch.arange(5)),  # not floating point: never looked at
        ("empty", torch.empty(0)),
    ]


def test_finite_tensors_pass() -> None:
    assert first_non_finite(_tensors()) is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["a", "b", "c"])
def test_a_non_finite_element_names_its_tensor(name: str, bad: float) -> None:
    tensors = _tensors()
    dict(tensors)[name].view(-1)[3] = bad
    assert first_non_finite(tensors) == name


def test_finite_values_whose_squares_overflow_are_finite() -> None:
    # A sum of squares overflows to infinity here; the element-wise look finds nothing.
    tensors = _tensors()
    dict(tensors)["a"][0, 0] = 1e30
    dict(tensors)["c"][0, 0] = 1e30
    assert first_non_finite(tensors) is None
    dict(tensors)["b"][0] = float("nan")
    assert first_non_finite(tensors) == "b"


# ---- FiniteCheck: prepared once over tensors whose values change --------------------------


def _check_sees_later_writes(tensors: list[tuple[str, torch.Tensor]], check: FiniteCheck) -> None:
    assert check.first_non_finite() is None
    named = dict(tensors)
    for name in ("a", "c"):
        named[name].view(-1)[2] = float("nan")
        assert check.first_non_finite() == name
        named[name].view(-1)[2] = 0.5
        assert check.first_non_finite() is None
    named["b"][0] = float("inf")
    named["a"][1, 1] = 1e30  # its square overflows; still finite
    assert check.first_non_finite() == "b"
    named["b"][0] = 0.0
    assert check.first_non_finite() is None


def test_a_prepared_check_sees_the_values_written_after_it_was_made() -> None:
    tensors = _tensors()
    _check_sees_later_writes(tensors, FiniteCheck(tensors))


def test_a_check_of_nothing_floating_is_finite() -> None:
    assert (
        FiniteCheck([("ids", torch.arange(3)), ("empty", torch.empty(0))]).first_non_finite()
        is None
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_check_is_replayed_as_a_graph_and_sees_new_values() -> None:
    tensors = [(n, t.cuda()) for n, t in _tensors()]
    check = FiniteCheck(tensors)
    assert check.first_non_finite() is None and check.uses_graph  # recorded after the first call
    _check_sees_later_writes(tensors, check)
    assert check.uses_graph
