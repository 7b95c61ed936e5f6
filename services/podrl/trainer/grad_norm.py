"""Global gradient norm and clipping over DTensor gradients on any mesh, and the relative size
of an optimizer step's update.

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


@torch.no_grad()
def snapshot_parameters(parameters: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    """fp32 copies of this rank's shards of the trainable parameters (for :func:`update_ratio`;
    fp32 because a step of lr 1e-6 is below bf16's resolution of a weight)."""
    return [
        _local(param).to(torch.float32, copy=True) for param in parameters if param.requires_grad
    ]


@torch.no_grad()
def update_ratio(parameters: Iterable[torch.nn.Parameter], before: list[torch.Tensor]) -> float:
    """||theta - before|| / ||theta|| over all trainable parameters as full tensors (every rank,
    a collective): the relative size of the step since :func:`snapshot_parameters`. Each local
    shard adds its squared sums, all-reduced over the mesh dimensions on which its parameter is
    sharded (never over replicated ones), as :func:`global_grad_norm` does."""
    params = [param for param in parameters if param.requires_grad]
    grouped: dict[tuple | None, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for param, old in zip(params, before, strict=True):
        key = (param.device_mesh, tuple(param.placements)) if isinstance(param, DTensor) else None
        now, then = grouped.setdefault(key, ([], []))
        now.append(_local(param).to(torch.float32))
        then.append(old)
    total = torch.zeros(2, dtype=torch.float32)
    for key, (now, then) in grouped.items():
        sums = torch.stack([_sum_of_squares(torch._foreach_sub(now, then)), _sum_of_squares(now)])
        if key is not None:
            mesh, placements = key
            for dim, placement in enumerate(placements):
                if placement.is_shard():
                    dist.all_reduce(sums, group=mesh.get_group(dim))
        total = total.to(sums.device) + sums
    delta, norm = total.sqrt().tolist()
    return delta / norm if norm > 0 else 0.0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach()
