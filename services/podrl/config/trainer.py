"""Trainer section of the run config: the policy model, its parallelism, optimizer and loss."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from podrl.config.base import Section, ServiceSection

#: Loopback addresses torchft's Lighthouse may bind (trainer.replication.lighthouse_server_bind):
#: IP addresses only, since a name such as localhost resolves through /etc/hosts, which may map
#: it elsewhere.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1"})


class ReplicationConfig(Section):
    """Data parallelism across worker pods (docs/scaling.md, "Trainers across pods"): every
    pod's trainer is one torchft replica group; gradients are summed across pods each step."""

    lighthouse_address: str = Field(
        "",
        description="host:port (or http://host:port) of the torchft Lighthouse that forms each "
        "step's quorum of pods (podrl-lighthouse); empty = no cross-pod replication: this "
        "trainer trains every batch alone.",
    )
    lighthouse_bind: str = Field(
        "[::]:29510",
        description="Where podrl-lighthouse listens for the trainers (host:port; [::] = every "
        "interface): its front, which forwards only the trainers' Quorum and Heartbeat calls, "
        "with replica ids that carry the run secret's MAC, to the torchft Lighthouse.",
    )
    lighthouse_server_bind: str = Field(
        "127.0.0.1:0",
        description="Where podrl-lighthouse runs the torchft Lighthouse itself (host:port on "
        "loopback; port 0 = a free one): it authenticates nobody and serves a status page "
        "and a kill endpoint, so only its front may reach it.",
    )
    quorum_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="How long one Train waits for the quorum of the step's pods (retries "
        "included) before it answers ABORTED.",
    )
    quorum_retry_seconds: float = Field(
        0.1,
        gt=0,
        le=1,
        description="A quorum that misses a pod of the step is asked for again after this "
        "pause, doubled at each attempt up to 1 s: shorter finds a late pod sooner, at more "
        "calls to the Lighthouse while pods start.",
    )
    join_timeout_seconds: float = Field(
        5.0,
        ge=0,
        description="Lighthouse: after a membership change, how long a quorum waits for pods "
        "that heartbeat but have not asked to join it.",
    )
    heartbeat_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="Lighthouse: a pod's trainer that has not heartbeated for this long is "
        "dead (left out of quorums).",
    )
    collective_timeout_seconds: float = Field(
        300.0,
        gt=0,
        description="Timeout of one cross-pod operation: the gradient all-reduce, the commit "
        "vote and the transfer of a healing pod's state.",
    )
    connect_timeout_seconds: float = Field(
        30.0, gt=0, description="Timeout of connecting to the Lighthouse and to peer pods."
    )
    backend: Literal["auto", "nccl", "gloo"] = Field(
        "auto",
        description="Backend of the cross-pod process group (torchft's reconfigurable one). "
        "auto: NCCL for CUDA parameters, gloo for CPU ones. gloo also reduces CUDA tensors, "
        "for pods that share one GPU, which NCCL refuses (one rank per GPU in a "
        "communicator); nccl needs device: cuda.",
    )
    manager_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of this pod's torchft manager server (peers and the Lighthouse "
        "reach it at trainer.advertise_host); 0 = a free port.",
    )
    store_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Port of this pod's TCPStore, where peers rendezvous for the cross-pod "
        "process group; 0 = a free port.",
    )
    gradient_bucket_mib: int = Field(
        256,
        ge=1,
        description="Gradients cross pods in flat buckets of about this many MiB, one "
        "all-reduce each: larger buckets take fewer round trips and more memory for the copy.",
    )

    @field_validator("lighthouse_server_bind")
    @classmethod
    def _loopback_server(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if host.strip("[]") not in LOOPBACK_HOSTS or not port.isdigit() or int(port) > 65535:
            raise ValueError(
                f"{value!r}: the torchft Lighthouse authenticates nobody, so it listens on "
                "loopback only; set host:port with host 127.0.0.1 or [::1] (port 0 = a free one), "
                "and trainer.replication.lighthouse_bind for the trainers' address"
            )
        return value

    @property
    def enabled(self) -> bool:
        return bool(self.lighthouse_address)


class OffPolicyConfig(Section):
    """The objective for off-policy tokens (docs/algorithms.md, "Off-policy correction").

    The behaviour weight of a token is w = exp(prox - mu): the trainer's probability of it at
    the start of the step (the proximal policy) over the generator's (the behaviour policy).
    """

    correction: Literal["none", "truncate"] = Field(
        "none",
        description="none: the PPO ratio is taken against the generator's logprobs (a trust "
        "region around the behaviour policy). truncate: the decoupled PPO objective, the ratio "
        "against the trainer's own logprobs at the start of the step (the proximal policy) "
        "and each token weighted by min(w, is_cap). Default: none in sync mode, truncate in "
        "async mode (config/coupling.py).",
    )
    is_cap: float = Field(
        2.0,
        gt=0,
        description="Cap C of the truncated behaviour weight min(w, C) (correction: truncate).",
    )
    mask: Literal["none", "token", "sequence"] = Field(
        "none",
        description="token: a token whose w lies outside [mask_low, mask_high] gets no "
        "policy-gradient term (IcePop); sequence: a sequence whose geometric-mean w lies "
        "outside the band is left out whole; none: no mask. Default: none in sync mode, token "
        "in async mode.",
    )
    mask_low: float = Field(
        0.5, gt=0, le=1, description="Lower end of the band of kept behaviour weights."
    )
    mask_high: float = Field(
        5.0, ge=1, description="Upper end of the band of kept behaviour weights."
    )


class TrainerConfig(ServiceSection):
    grpc_port: int = Field(50053, ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(9103, ge=0, le=65535, description="Prometheus port (0 = off).")

    # The model.
    model_path: Path | None = Field(
        None,
        description="Hugging Face safetensors folder of the initial policy (config.json, "
        "*.safetensors, tokenizer). Unset: the project's tiny Qwen3, written once under "
        "<run_dir>/models/tiny (no download).",
    )
    attn_implementation: Literal["sdpa", "eager"] = Field(
        "sdpa",
        description="Attention used for training: sdpa = podrl's mask-free attention "
        "(causal SDPA over right-padded rows, flash varlen over packed rows on CUDA); eager = "
        "transformers' eager attention with a padding mask.",
    )

    # Parallelism: the trainer runs dp_shard * tp ranks.
    dp_shard: int = Field(
        1,
        ge=1,
        description="FSDP2 (fully_shard) data-parallel degree: parameters, gradients "
        "and optimizer state are sharded over this many ranks, each training on its share of "
        "the batch.",
    )
    tp: int = Field(
        1,
        ge=1,
        description="Tensor-parallel degree (parallelize_module: q/k/v/gate/up "
        "column-wise, o/down row-wise). Must divide the model's attention and KV heads.",
    )
    master_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="TCP port of the ranks' rendezvous when podrl-trainer "
        "starts its own ranks; 0 = pick a free port.",
    )
    collective_timeout_seconds: float = Field(
        1800.0,
        gt=0,
        description="Timeout of one collective (a rank that does not answer "
        "within it fails the step).",
    )
    command_idle_timeout_seconds: float = Field(
        30 * 24 * 3600.0,
        gt=0,
        description="How long trainer ranks > 0 wait for rank 0's next command (an idle "
        "trainer between two RPCs) before their command loop fails and they exit; the "
        "timeout of the rank command loop's own gloo group.",
    )
    weights_ack_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description="GPU trainers publish their live parameters: how long an optimizer step "
        "waits for the acknowledgement of the version published last before it fails rather "
        "than overwrite weights a generator may be reading. The gRPC service refuses such a "
        "Train up front (FAILED_PRECONDITION); this wait guards a step driven directly.",
    )

    # Optimizer (AdamW) and schedule.
    lr: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Learning-rate shape after warmup: constant, linear decay to "
        "min_lr_ratio * lr at total_steps, or cosine decay to the same floor.",
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup from 0 to lr over these steps.")
    total_steps: int = Field(
        1000, ge=1, description="Length of the decay of the linear/cosine schedules."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="Floor of the decaying schedules, as a fraction of lr."
    )
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(
        1.0, ge=0, description="Clip the global gradient norm to this value; 0 = no clipping."
    )
    micro_batch_size: int = Field(
        8,
        ge=1,
        description="Sequences per forward/backward on one rank; gradients accumulate "
        "over micro-batches into one optimizer step.",
    )

    # Speed (docs/cuda.md, "Trainer speed"): none of these changes what is computed (fsdp: on
    # CUDA, which values are rounded to bf16).
    packing: bool = Field(
        True,
        description="Pack each micro-batch's sequences into one row (positions restart per "
        "sequence, attention stays inside each) so padding is never computed; a micro-batch "
        "of equal lengths stays rows (no padding there, faster kernels); false = right-padded "
        "rows. Needs attn_implementation sdpa.",
    )
    fused_logprobs: bool = Field(
        True,
        description="Compute the sampled tokens' logprobs with podrl's chunked vocabulary "
        "projection + log-softmax (no full-vocabulary fp32 logits, prompt positions skipped); "
        "false = the model's full logits and a plain fp32 log_softmax.",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Also cap each micro-batch at this many computed tokens (packed: the sum "
        "of the lengths; rows: rows x the longest); unset = micro_batch_size alone decides. "
        "With packing, a budget instead of a sequence count keeps micro-batches full.",
    )
    logprob_chunk_tokens: int = Field(
        4096,
        ge=1,
        description="Tokens per chunk of the fused logprobs: a chunk holds [tokens, vocab] "
        "logits (4096 x 151,936 bf16 = 1.2 GB).",
    )
    compile_layers: bool | None = Field(
        None,
        description="torch.compile each decoder layer's forward (and the fused logprobs' "
        "element-wise kernels); null = on for CUDA, off on CPU (compiling costs more there "
        "than it saves).",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each decoder layer's activations in backward instead of keeping "
        "them: less memory, about a third more compute; for batches that do not fit.",
    )
    fsdp: Literal["auto", "always"] = Field(
        "auto",
        description="auto: FSDP2 (fully_shard) over the dp_shard ranks when the trainer has "
        "more than one rank; a trainer of one rank (dp_shard 1, tp 1) trains the plain module, "
        "without FSDP's per-layer hooks and DTensor dispatch (on CUDA in bf16 autocast over its "
        "fp32 weights). always: FSDP2 over one rank too (every parameter a DTensor, computed "
        "in bf16 through FSDP's mixed-precision policy on CUDA), the path before auto.",
    )
    optimizer_impl: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        "auto",
        description="AdamW implementation: fused (one kernel per step), foreach (one kernel "
        "per op over all tensors) or for_loop; auto = with tp = 1 (all parameters on one "
        "mesh) fused on CUDA and foreach on CPU, otherwise torch's default.",
    )

    # Loss (formulas: docs/algorithms.md, podrl.algorithms.losses).
    loss_mode: Literal["grpo", "dapo", "dr_grpo"] = Field(
        "grpo",
        description="grpo: mean over sequences of per-sequence token means; dapo: "
        "token-level mean over the batch; dr_grpo: token sum over batch size * "
        "dr_grpo_max_tokens.",
    )
    clip_eps_low: float = Field(
        0.2, ge=0, lt=1, description="PPO clip below: ratios under 1 - clip_eps_low are clipped."
    )
    clip_eps_high: float = Field(
        0.2,
        ge=0,
        description="PPO clip above: ratios over 1 + clip_eps_high are clipped "
        "(DAPO's clip-higher uses 0.28).",
    )
    clip_ratio_c: float | None = Field(
        3.0,
        description="Dual clip for negative advantages (as verl): a token with A < 0 adds at "
        "most -A * clip_ratio_c to the loss however large its ratio; must be > 1; null or 0 "
        "= no dual clip.",
    )
    dr_grpo_max_tokens: int = Field(
        1024,
        ge=1,
        description="Dr. GRPO's constant normaliser: the generation budget "
        "(the generator's max_tokens).",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the k3 KL penalty to a frozen copy of the initial "
        "model; 0 = no reference model is loaded.",
    )
    off_policy: OffPolicyConfig = Field(
        default_factory=OffPolicyConfig,
        description="Correction for tokens the trainer's policy did not sample (a stale "
        "version in async mode, a generator computing differently): the decoupled objective "
        "and masking of extreme importance weights. Unset fields follow loop.mode (sync: none; "
        "async: truncate + token mask).",
    )
    tis_cap: float | None = Field(
        None,
        description="Replaced by trainer.off_policy (correction: truncate, is_cap: C); "
        "refused when set.",
    )
    logit_temperature: float = Field(
        1.0,
        gt=0,
        description="Divide logits by this before log-softmax; set it to the "
        "sampling temperature when the generator reports logprobs of the tempered distribution.",
    )

    # Across pods.
    replication: ReplicationConfig = Field(
        default_factory=ReplicationConfig,
        description="Data parallelism across worker pods through torchft (off by default).",
    )

    # Reproducibility and checkpoints.
    seed: int = Field(0, description="Seed of torch's RNGs on every rank.")
    checkpoint_dir: Path | None = Field(
        None,
        description="Where SaveCheckpoint writes when the request names no path; unset "
        "= <run_dir>/checkpoints. SaveCheckpoint and LoadCheckpoint accept paths under it or "
        "under run_dir only (docs/trainer.md).",
    )
    checkpoint_keep_latest: int = Field(
        3,
        ge=0,
        description="Keep this many of the latest checkpoints SaveCheckpoint wrote under "
        "checkpoint_dir (by step; older ones are deleted after each save); 0 = keep all.",
    )
    export_dir: Path | None = Field(
        None,
        description="Where ExportHF writes when the request names no path; unset = "
        "<run_dir>/exports. ExportHF accepts paths under it or under run_dir only.",
    )

    @property
    def world_size(self) -> int:
        """Number of trainer ranks (processes)."""
        return self.dp_shard * self.tp

    @field_validator("clip_ratio_c")
    @classmethod
    def _check_clip_ratio_c(cls, value: float | None) -> float | None:
        if value is None or value == 0:
            return None
        if not value > 1:
            raise ValueError(
                f"must be > 1 (verl's default is 3.0), or null/0 to turn the dual clip off; "
                f"got {value}"
            )
        return value

    @field_validator("tis_cap")
    @classmethod
    def _refuse_tis_cap(cls, value: float | None) -> None:
        if value is not None:
            raise ValueError(
                f"tis_cap was replaced by trainer.off_policy: set off_policy: {{correction: "
                f"truncate, is_cap: {value}}} (and mask: none for the old objective exactly)"
            )
        return None

    @model_validator(mode="after")
    def _check_packing(self) -> TrainerConfig:
        if self.packing and self.attn_implementation != "sdpa":
            raise ValueError(
                "trainer.packing needs trainer.attn_implementation: sdpa (the eager attention "
                "takes a padding mask); set packing: false to use eager"
            )
        return self

    @model_validator(mode="after")
    def _check_warmup(self) -> TrainerConfig:
        # An unset total_steps follows loop.steps (config/coupling.py checks warmup against the
        # value it ends up with), so only an explicit one is checked here.
        explicit = "total_steps" in self.model_fields_set
        if explicit and self.lr_schedule != "constant" and self.warmup_steps >= self.total_steps:
            raise ValueError(
                f"trainer.warmup_steps ({self.warmup_steps}) must be below trainer.total_steps "
                f"({self.total_steps}) for the {self.lr_schedule} schedule"
            )
        return self
