"""A trainer of 4 gloo ranks (spawned by the tests) that publishes a small Qwen3 under three
parallel layouts in turn: FSDP2 over 2 ranks (two replica groups), TP over 2 ranks (two
replica groups) and FSDP2 x TP on a 2 x 2 mesh.

Per layout, version 1 goes out as a full manifest; after the test writes ``ack-<layout>-1``
every rank adds 1.0 to its local shards in place (like an optimizer step) and publishes
version 2 (version-only). Rank 0 writes ``manifest-<layout>-<v>.bin``. All publishers stay
alive (their shared memory mapped by the test) until ``done`` appears.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from tests.file_handshake import wait_for

MESH_KINDS = ("fsdp2", "tp2", "fsdp2xtp2")
WORLD = 4


def _parallelize(model: torch.nn.Module, mesh_kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    tp_plan = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(),
    }
    if mesh_kind == "fsdp2xtp2":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
        parallelize_module(model, mesh["tp"], tp_plan)
        fsdp_mesh = mesh["fsdp"]
    else:
        # Two independent groups of 2 ranks; the other mesh dim is a pure replica.
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "group"))
        if mesh_kind == "tp2":
            parallelize_module(model, mesh["group"], tp_plan)
            return
        fsdp_mesh = mesh["group"]
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)


def run_rank(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from podrl.weights import ManifestAssembler, WeightPublisher
    from podrl.weights.distributed import gather_publications
    from tests.weights.tiny_qwen3 import make_model

    out = Path(out_dir)
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    keep = []
    for mesh_kind in MESH_KINDS:
        model = make_model()
        _parallelize(model, mesh_kind)
        publisher = WeightPublisher(model, rank=rank)
        assembler = ManifestAssembler("trainer-test")
        keep.append((model, publisher))
        for version in (1, 2):
            if version == 2:
                wait_for(out / f"ack-{mesh_kind}-1")
                publisher.finish(1)
                with torch.no_grad():
                    for param in model.parameters():
                        local = param.to_local() if hasattr(param, "to_local") else param
                        local.add_(1.0)
            parts = gather_publications(publisher.start(version))
            if rank == 0:
                manifest = assembler.assemble(version, parts)
                tmp = out / f"manifest-{mesh_kind}-{version}.tmp"
                tmp.write_bytes(manifest.SerializeToString())
                tmp.rename(out / f"manifest-{mesh_kind}-{version}.bin")
    wait_for(out / "done")
    dist.barrier()
    dist.destroy_process_group()
