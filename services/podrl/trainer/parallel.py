"""The trainer's process group, device mesh and the parallelised transformers model.

Mesh: ``("dp_shard", "tp")`` of shape ``(dp_shard, tp)`` over all ranks. Tensor parallelism
(``parallelize_module``) splits attention and MLP projections over ``tp``; FSDP2
(``fully_shard``) then shards every parameter over ``dp_shard``. A trainer of one rank
(``trainer.fsdp: auto``) trains the plain module instead: over one rank FSDP2 shards nothing and
gathers nothing, yet its per-layer hooks and the DTensor dispatch of every parameter op cost
host time each step that does not shrink with the batch (docs/performance.md, "The trainer's
fixed cost"). On CUDA the model computes in bf16 and keeps fp32 master weights: FSDP2's
MixedPrecisionPolicy (bf16 parameters in compute), or bf16 autocast over the plain module
(:func:`compute_context`); on CPU everything is fp32.

Attention: ``attn_implementation: sdpa`` loads the model with podrl's own attention
(``podrl.trainer.batch``'s packed attention: causal SDPA for right-padded rows, flash varlen
for packed rows, never a materialised mask). Speed options applied per decoder layer, inside
each FSDP unit (the FSDP hooks stay outside): ``torch.compile`` of the layer's ``forward`` and
activation checkpointing of it. Both replace only the instance's ``forward`` attribute, so parameter
names, state-dict keys and checkpoints are unchanged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from podrl.config import ConfigError, RunConfig
from podrl.models.folders import default_model_folder, ensure_model_folder
from podrl.trainer.batch import ATTENTION_NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the trainer's world (torchrun-style environment)."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        )


def wants_cuda(config: RunConfig) -> bool:
    """``device: cuda``, or ``auto`` on a machine where torch sees a GPU."""
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def resolve_device(config: RunConfig, env: RankEnv) -> torch.device:
    if wants_cuda(config):
        if not torch.cuda.is_available():
            raise ConfigError("device: cuda requested but torch sees no GPU; set device: cpu")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    torch.set_num_threads(cpu_threads())
    return torch.device("cpu")


def cpu_threads(environ: Mapping[str, str] | None = None) -> int:
    """Intra-op threads of a CPU trainer rank: ``OMP_NUM_THREADS`` when set, else every core
    this process may use less one, at least one. On CPU the pod's vLLM worker shares the
    cores, and it busy-polls for about a second after each Generate (vLLM's shared-memory
    queue), which is when the trainer steps; a trainer that also takes that core waits for it
    at every parallel region (docs/performance.md)."""
    environ = os.environ if environ is None else environ
    configured = environ.get("OMP_NUM_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return max(1, len(os.sched_getaffinity(0)) - 1)


def init_distributed(config: RunConfig, env: RankEnv, device: torch.device) -> DeviceMesh:
    """Join the trainer's process group and build the ``(dp_shard, tp)`` mesh."""
    trainer = config.trainer
    if env.world_size != trainer.world_size:
        raise ConfigError(
            f"trainer.dp_shard * trainer.tp = {trainer.world_size} but this process was started "
            f"with WORLD_SIZE={env.world_size}; make them equal"
        )
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(seconds=trainer.collective_timeout_seconds)
        if env.world_size == 1 and "MASTER_ADDR" not in os.environ:
            # One process and no rendezvous given: an in-process store is all it needs.
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(
                backend, rank=env.rank, world_size=env.world_size, timeout=timeout
            )
    return init_device_mesh(
        device.type, (trainer.dp_shard, trainer.tp), mesh_dim_names=("dp_shard", "tp")
    )


def resolve_model_path(config: RunConfig) -> Path:
    """The configured model folder, or the project's tiny model (written once, atomically)."""
    if config.trainer.model_path is not None:
        return ensure_model_folder(Path(config.trainer.model_path), False, "trainer.model_path")
    return ensure_model_folder(default_model_folder(config.run_dir), True)


def load_hf_model(path: Path, attn_implementation: str) -> PreTrainedModel:
    """The causal LM in fp32 on CPU (parallelisation moves and shards it); ``sdpa`` means
    podrl's mask-free SDPA/varlen attention (module docstring), ``eager`` transformers' own."""
    hf_config = AutoConfig.from_pretrained(path)
    implementation = ATTENTION_NAME if attn_implementation == "sdpa" else attn_implementation
    model = AutoModelForCausalLM.from_pretrained(
        path, config=hf_config, dtype=torch.float32, attn_implementation=implementation
    )
    model.config.use_cache = False
    return model


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            f"trainer.model_path: {type(model).__name__} has no model.layers; podrl parallelises "
            "Llama-style decoders (Qwen3, Llama, ...)"
        )
    return layers


def check_tp(model: PreTrainedModel, tp: int) -> None:
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", heads)
    inter = config.intermediate_size
    for name, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv_heads),
        ("intermediate_size", inter),
    ):
        if value % tp:
            raise ConfigError(
                f"trainer.tp: {tp} does not divide the model's {name} ({value}); choose a tp "
                "that divides it"
            )


def apply_tensor_parallel(model: PreTrainedModel, tp_mesh: DeviceMesh) -> None:
    """Megatron-style TP: colwise q/k/v/gate/up, rowwise o/down; embeddings, norms and lm_head
    stay replicated. Qwen3's per-head q/k norms see only the local heads: they are marked
    sharded on the head dimension so their gradients are summed over the tp ranks."""
    for layer in _decoder_layers(model):
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        for norm in ("q_norm", "k_norm"):
            if hasattr(layer.self_attn, norm):
                plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(layer, tp_mesh, plan)


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` whose activations are recomputed in backward instead of kept."""

    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def wrap_decoder_layers(
    model: PreTrainedModel, compile_layers: bool, activation_checkpointing: bool
) -> None:
    """Compile and/or checkpoint every decoder layer's ``forward`` in place (module docstring).

    Compiled, the layers share one graph: they are instances of one class and dynamo lifts
    their parameters to graph inputs. A new sequence length recompiles once, then the graph is
    dynamic in it.
    """
    if not (compile_layers or activation_checkpointing):
        return
    for layer in _decoder_layers(model):
        forward = layer.forward
        if compile_layers:
            forward = torch.compile(forward)
        if activation_checkpointing:
            forward = _checkpointed(forward)
        layer.forward = forward


def uses_fsdp(fsdp: str, world_size: int) -> bool:
    """Whether the model is wrapped by FSDP2 (``trainer.fsdp``): always, or over several ranks."""
    return fsdp == "always" or world_size > 1


def compute_context(
    device: torch.device, fsdp: bool
) -> Callable[[], AbstractContextManager[object]]:
    """The context of a forward, as a factory the step calls (torch's own, so the step runs no
    code of this module): bf16 autocast for a plain module on CUDA (FSDP2's policy casts the
    parameters itself), nothing otherwise."""
    if device.type == "cuda" and not fsdp:
        return partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    return nullcontext


def parallelize(
    model: PreTrainedModel,
    mesh: DeviceMesh,
    device: torch.device,
    trainable: bool = True,
    compile_layers: bool = False,
    activation_checkpointing: bool = False,
    fsdp: bool = True,
) -> PreTrainedModel:
    """TP over ``mesh["tp"]`` (if > 1), then FSDP2 over ``mesh["dp_shard"]`` (or, ``fsdp``
    false on a one-rank mesh, the plain module on ``device``), in place; then the per-layer
    speed options (:func:`wrap_decoder_layers`)."""
    if mesh["tp"].size() > 1:
        check_tp(model, mesh["tp"].size())
        apply_tensor_parallel(model, mesh["tp"])
    if fsdp:
        if device.type == "cuda":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        else:
            policy = MixedPrecisionPolicy()
        dp_mesh = mesh["dp_shard"]
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
        # fully_shard moves parameters and buffers to the mesh's device.
        fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    else:
        if mesh.size() != 1:
            raise ValueError(f"a plain module trains on one rank, not a mesh of {mesh.size()}")
        model.to(device)
    wrap_decoder_layers(model, compile_layers, activation_checkpointing and trainable)
    if not trainable:
        model.eval()
        model.requires_grad_(False)
    return model
