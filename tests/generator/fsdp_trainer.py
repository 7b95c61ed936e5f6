"""A trainer of N gloo ranks for the end-to-end test, built from the trainer's own parts
(``podrl.trainer.parallel``: HF model, FSDP2 over a (dp_shard, tp) mesh) and the weights
publisher. It talks to the test through files in ``--out``:

for v in 1, 2:  (v == 2: wait ``ack-1``, acknowledge, change every local shard in place)
    publish v -> rank 0 writes ``manifest-<v>.bin``
    wait ``sequences-<v>.json`` ([[prompt_ids, completion_ids], ...]) -> the FSDP2 model scores
    them (all ranks) -> rank 0 writes ``logprobs-<v>.json``
then every rank writes ``pid-<rank>`` and waits (the test kills it with SIGKILL).

Run: python -m tests.generator.fsdp_trainer RANK WORLD PORT MODEL_DIR OUT_DIR PUBLISHER_ID
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.file_handshake import wait_for, write_atomic


@torch.no_grad()
def _score(model: torch.nn.Module, sequences: list[list[list[int]]]) -> list[list[float]]:
    out = []
    for prompt, completion in sequences:
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        picked = torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])
        out.append(picked[:, 0].tolist())
    return out


def main(rank: int, world: int, port: int, model_dir: str, out_dir: str, publisher: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    from podrl.trainer.parallel import load_hf_model, parallelize
    from podrl.weights import ManifestAssembler, WeightPublisher
    from podrl.weights.distributed import gather_publications
    from podrl.weights.protocol import load_trainer_key

    out = Path(out_dir)
    model = load_hf_model(Path(model_dir), "sdpa")
    torch.manual_seed(7)  # same noise on every rank: the policy differs from the folder's
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.5 * torch.randn_like(param))
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_shard", "tp"))
    parallelize(model, mesh, torch.device("cpu"), trainable=False)
    publisher_ = WeightPublisher(model, rank=rank)
    # Signed with the pod's key, as the trainer service does (PODRL_WEIGHTS_KEY_FILE).
    assembler = ManifestAssembler(publisher, load_trainer_key() if rank == 0 else None)
    for version in (1, 2):
        if version == 2:
            wait_for(out / "ack-1", timeout=600)
            publisher_.finish(1)
            torch.manual_seed(100 + rank)  # an "optimizer step": in place, per local shard
            with torch.no_grad():
                for param in model.parameters():
                    param.to_local().add_(0.3 * torch.randn_like(param.to_local()))
        parts = gather_publications(publisher_.start(version))
        if rank == 0:
            manifest = assembler.assemble(version, parts)
            write_atomic(out / f"manifest-{version}.bin", manifest.SerializeToString())
        wait_for(out / f"sequences-{version}.json", timeout=600)
        scores = _score(model, json.loads((out / f"sequences-{version}.json").read_text()))
        # The root FSDP module keeps its parameters unsharded after a forward; shard them again
        # so the published (sharded) storage is what the next step updates.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        if rank == 0:
            write_atomic(out / f"logprobs-{version}.json", json.dumps(scores).encode())
    (out / f"pid-{rank}").write_text(str(os.getpid()))
    wait_for(out / "done", timeout=3600)


if __name__ == "__main__":
    rank, world, port = (int(a) for a in sys.argv[1:4])
    main(rank, world, port, *sys.argv[4:7])
