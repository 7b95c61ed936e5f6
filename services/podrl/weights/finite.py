"""One cheap check that a set of tensors holds no NaN and no infinity.

Per (device, dtype) group, one multi-tensor max-magnitude reduction (``torch._foreach_norm``
with ``inf``: NaN propagates through it, and a max never overflows the way a sum of squares
would); only when a group's result is not finite are its tensors looked at one by one, to name
one. The trainer runs it before it publishes, the generator's receiver before it copies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def first_non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of a tensor holding NaN or infinity, or None when every element is finite."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        if tensor.numel() and (tensor.is_floating_point() or tensor.is_complex()):
            groups.setdefault((tensor.device, tensor.dtype), []).append((name, tensor))
    for group in groups.values():
        with torch.no_grad():
            largest = torch.stack(torch._foreach_norm([t for _, t in group], math.inf))
            if bool(torch.isfinite(largest.float().sum())):
                continue
            return next(name for name, t in group if not bool(torch.isfinite(t).all()))
    return None
