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


def _sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum of x**2 over all ``tensors`` in fp32: one foreach norm kernel per dtype and device
    instead of three kernels per tensor."""
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.stack(norms).pow(2).sum()


def global_grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The L2 norm of all gradients as if they were full tensors (fp32 scalar, every rank)."""
    grouped: dict[tuple, list[torch.Tensor]] = {}
    plain_grads: list[torch.Tensor] = []
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            if any(p.is_partial() for p in grad.placements):
                raise RuntimeError("gradient with a Partial placement: reduce it before clipping")
            key = (grad.device_mesh, tuple(grad.placements))
            grouped.setdefault(key, []).append(grad.to_local().detach())
        else:
            plain_grads.append(grad.detach())
    groups = {key: _sum_of_squares(locals_) for key, locals_ in grouped.items()}
    total = _sum_of_squares(plain_grads) if plain_grads else torch.zeros(())
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
        locals_ = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
        # One multiply kernel per (device, dtype) group, with the coefficient on the device:
        # no host synchronisation.
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for local in locals_:
            by_kind.setdefault((local.device, local.dtype), []).append(local)
        for (device, dtype), tensors in by_kind.items():
            torch._foreach_mul_(tensors, coef.to(device, dtype))
    return norm
