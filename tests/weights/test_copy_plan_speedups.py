"""CPU checks of the copy-plan and publisher speed-ups (docs/cuda.md §3): lane balancing and the
cheap per-publish storage check still notice every storage change."""

from __future__ import annotations

import torch

from podrl.weights.publisher import ManifestAssembler, WeightPublisher
from podrl.weights.receiver import CopyOp, CopyPlan, balance_lanes


def _op(numel: int) -> CopyOp:
    return CopyOp(f"t{numel}", torch.zeros(numel), torch.zeros(numel))


def test_lanes_hold_every_op_once_largest_first_and_balanced() -> None:
    ops = [_op(n) for n in (5, 100, 7, 60, 40, 1, 1, 30)]
    lanes = balance_lanes(ops, 3)
    flat = [op for lane in lanes for op in lane]
    assert sorted(id(op) for op in flat) == sorted(id(op) for op in ops)
    assert [lane[0].dst.numel() for lane in lanes] == [100, 60, 40]  # big copies start first
    loads = [sum(op.dst.numel() for op in lane) for lane in lanes]
    assert loads[0] == 100 and abs(loads[1] - loads[2]) <= 5  # 100 is one copy on its own
    assert balance_lanes(ops[:2], 8) == [[ops[1]], [ops[0]]]  # no empty lanes


def test_cpu_plan_copies_with_any_stream_count() -> None:
    ops = [CopyOp("a", torch.arange(6.0), torch.zeros(6, dtype=torch.bfloat16))]
    CopyPlan(ops, streams=3).run()
    assert torch.equal(ops[0].dst, torch.arange(6.0).to(torch.bfloat16))


def test_cached_storage_check_still_sees_every_storage_change() -> None:
    params = {f"p{i}": torch.zeros(4, 4) for i in range(5)}
    publisher = WeightPublisher(lambda: params, staging="shm")
    assembler = ManifestAssembler("trainer")
    version = 0

    def publish() -> bool:
        nonlocal version
        version += 1
        part = publisher.start(version)
        publisher.finish(version)
        return assembler.assemble(version, [part]).version_only

    try:
        assert not publish()  # first: full
        assert publish()
        params["p1"].add_(1.0)  # in place: same storage
        assert publish()
        params["p2"].data = torch.zeros(4, 4)  # same object, new storage
        assert not publish()
        params["p3"] = torch.zeros(4, 4)  # new object
        assert not publish()
        params["p9"] = torch.zeros(2)  # new name
        assert not publish()
        del params["p9"]
        assert not publish()
        assert publish()
    finally:
        publisher.close()
