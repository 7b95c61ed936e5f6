"""One cheap check that a set of tensors holds no NaN and no infinity.

Per (device, dtype) group, one multi-tensor L2 norm (``torch._foreach_norm``): a sum of squares
propagates NaN and infinity and cannot cancel them, so a finite result means every element is
finite. Only when a group's result is not finite are its tensors looked at one by one, to name
one; finite values so large that their squares overflow are found finite there. On CPU the L2
norm is about ten times faster than the max-magnitude (``inf``) norm or ``isfinite`` over the
same tensors (0.2 against 2.0 ms for the tiny model's 25 parameters). The trainer runs it before
it publishes, the generator's receiver before it copies.
"""

from __future__ import annotations

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
            norms = torch.stack(torch._foreach_norm([t for _, t in group], 2.0))
            if bool(torch.isfinite(norms.float().sum())):
                continue
            bad = next((name for name, t in group if not bool(torch.isfinite(t).all())), None)
            if bad is not None:
                return bad
    return None
