"""The CUDA copy plan on its own: the multi-stream graph and peer sources mapped on the
destination GPU (the speed work of docs/cuda.md §3) copy exactly what the eager loop copies."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from podrl.v1 import weights_pb2
from podrl.weights import cuda_ipc
from podrl.weights.receiver import CopyOp, CopyPlan

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _sources(device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Mixed sizes like a model: big matrices, norm vectors, and strided column slices."""
    gen = torch.Generator(device=device).manual_seed(1)
    shapes = [(4096, 1024), (64,), (1024, 3072), (128,), (7, 5)] * 8
    return [torch.randn(s, generator=gen, device=device).to(dtype) for s in shapes]


def _ops(srcs: list[torch.Tensor], device: str) -> list[CopyOp]:
    ops = []
    for i, src in enumerate(srcs):
        view = src[:, 1::2] if src.dim() == 2 and i % 3 == 0 else src  # a strided block too
        dst = torch.zeros(view.shape, dtype=torch.bfloat16, device=device)
        ops.append(CopyOp(f"t{i}", view, dst))
    return ops


@pytest.mark.parametrize("device", ["cuda:0", "cuda:1"][: max(1, GPUS)])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("streams", [1, 4])
def test_graph_over_streams_copies_every_op(
    src_dtype: torch.dtype, streams: int, device: str
) -> None:
    srcs = _sources(device, src_dtype)
    plan = CopyPlan(_ops(srcs, device), streams=streams)
    plan.run()  # eager, then captured
    assert plan.uses_graph
    for round_ in range(2):  # replays read the sources' current contents
        for src in srcs:
            src.mul_(-1.5).add_(round_)
        plan.run()
        for op in plan.ops:
            assert torch.equal(op.dst, op.src.to(torch.bfloat16)), op.target


def _export(queue, done) -> None:
    torch.cuda.set_device(0)
    tensor = torch.arange(1 << 20, device="cuda:0").reshape(1024, 1024).to(torch.bfloat16)
    torch.cuda.synchronize()
    queue.put(cuda_ipc.export_tensor(tensor).SerializeToString())
    done.wait(120)


@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
def test_peer_source_mapped_on_the_destination_gpu() -> None:
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_export, args=(queue, done))
    proc.start()
    try:
        handle = weights_pb2.CudaIpcHandle.FromString(queue.get(timeout=120))
        storage, index = cuda_ipc.open_storage(handle, on_device=1)
        assert index == 1  # H200s over NVLink: peer access, so mapped on GPU1
        src = torch.empty(0, dtype=torch.bfloat16, device="cuda:1").set_(
            storage, handle.tensor_offset // 2, (1024, 1024), (1024, 1)
        )
        dst = torch.zeros(1024, 1024, dtype=torch.bfloat16, device="cuda:1")
        plan = CopyPlan([CopyOp("w", src, dst)])
        plan.run()  # eager, then captured
        assert plan.uses_graph  # one GPU as far as the plan is concerned
        dst.zero_()
        plan.run()  # the graph replay alone must fill dst again
        want = torch.arange(1 << 20).reshape(1024, 1024).to(torch.bfloat16)
        assert torch.equal(dst.cpu(), want)
        del plan, src, storage
    finally:
        done.set()
        proc.join(60)
