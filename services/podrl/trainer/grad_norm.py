"""Global gradient norm and clipping over DTensor gradients on any mesh.

``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when parameters live
on different meshes (FSDP-only parameters on the dp mesh, FSDP+TP ones on the 2-D mesh). Here
each gradient contributes the squared sum of its local shard; the sums are all-reduced over the
mesh dimensions on which that gradient is sharded (never over replicated ones), then added.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def global_grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The L2 norm of all gradients as if they were full tensors (fp32 scalar, every rank)."""
    groups: dict[tuple, torch.Tensor] = {}
    plain: torch.Tensor | None = None
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise RuntimeError("gradient with a Partial placement: reduce it before clipping")
            key = (grad.device_mesh, tuple(grad.placements))
            local = grad.to_local().detach().float().pow(2).sum()
            groups[key] = groups[key] + local if key in groups else local
        else:
            local = grad.detach().float().pow(2).sum()
            plain = local if plain is None else plain + local
    total = plain if plain is not None else torch.zeros(())
    for (mesh, placements), sumsq in groups.items():
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                dist.all_reduce(sumsq, group=mesh.get_group(dim))
        total = total.to(sumsq.device) + sumsq
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0 = only measure)."""
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params)
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for param in params:
            grad = param.grad
            local = grad.to_local() if isinstance(grad, DTensor) else grad
            local.mul_(coef.to(local.device, local.dtype))
    return norm
