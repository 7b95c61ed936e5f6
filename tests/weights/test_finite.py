"""The finiteness check the trainer runs before it publishes and the receiver before it copies
(services/podrl/weights/finite.py)."""

from __future__ import annotations

import pytest
import torch

from podrl.weights.finite import first_non_finite


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
