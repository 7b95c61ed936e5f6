"""The weight-sync benchmark's baselines copy exactly what podrl's receiver copies.

A baseline that dropped or misplaced a tensor would be timed doing less work than a real sync;
these checks run the baselines' own code (bench/weight_sync.py) on a small Qwen3 shape, over a
real pipe and real shared memory, against podrl's validated receiver.
"""

from __future__ import annotations

import multiprocessing as mp
import threading

import torch

from bench.weight_sync import BaselineReceiver, BucketSender, make_params, per_param_manifest
from podrl.v1 import weights_pb2
from podrl.weights import ModelDescription, WeightReceiver, vllm_layout

SMALL_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 128,
    "num_hidden_layers": 2,
    "tie_word_embeddings": False,
}


def _zeros(layout, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(target.shape, dtype=dtype) for name, target in layout.items()}


def _serve_buckets(conn, receiver: BaselineReceiver) -> None:
    """The generator side of one bucketed sync, as bench/weight_sync.py's generator runs it."""
    while True:
        mode, payload = conn.recv_bytes().split(b"|", 1)
        last = mode == b"bucket_last"
        bucket = weights_pb2.WeightManifest.FromString(payload)
        receiver.receive_bucket(conn, bucket, last=last, clone=False)
        if last:
            conn.send_bytes(b"{}")
            return


def test_baselines_fill_the_fused_layout_as_podrl_does() -> None:
    description = ModelDescription.from_hf_config(SMALL_QWEN3)
    layout = vllm_layout(description, 0, 1)
    params = make_params(description, torch.float32, "cpu")
    keep: list = []
    try:
        full = per_param_manifest(params, 1, keep)
        expected = _zeros(layout, torch.bfloat16)
        WeightReceiver(description, layout=layout).apply(full, expected)
        assert all(tensor.abs().sum() > 0 for tensor in expected.values())

        per_param = _zeros(layout, torch.bfloat16)
        BaselineReceiver(layout, per_param).load(full.shards, clone=False).run()

        buckets = _zeros(layout, torch.bfloat16)
        trainer_end, generator_end = mp.Pipe()
        server = threading.Thread(
            target=_serve_buckets, args=(generator_end, BaselineReceiver(layout, buckets))
        )
        server.start()
        # A bucket the size of the largest parameter: the layers' q/k/v (fused into one
        # qkv_proj) and gate/up are spread over several buckets.
        sender = BucketSender(params, bucket_bytes=1)
        sender.sync(trainer_end, 2)
        server.join(timeout=60)
        assert sender.bucket_bytes == max(t.numel() * t.element_size() for t in params.values())
        assert sender.buckets >= 4
    finally:
        for staging in keep:
            staging.close()
    for name in layout:
        assert torch.equal(per_param[name], expected[name]), name
        assert torch.equal(buckets[name], expected[name]), name
