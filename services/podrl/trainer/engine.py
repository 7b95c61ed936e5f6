"""TrainerEngine: the policy model, its optimizer and schedule, the step and policy version.

One engine lives on every trainer rank; rank 0 validates requests and drives the others through
the rank command loop (``podrl.trainer.servicer``), every rank then calls the same engine
method with the same arguments. The engine owns what the step changes besides the weights, with
no other owner: the :class:`TrainState` (policy version, last applied Train, LR schedule, RNG;
the learning rate's multiplier is :func:`lr_multiplier`) and the gradient norm that clips the
step and the update size it reports (:func:`clip_grad_norm`, :func:`update_ratio`, correct for
DTensor gradients on any mesh).
"""

from __future__ import annotations

import base64
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from podrl.algorithms.losses import LossSettings, policy_loss
from podrl.common import faults
from podrl.common.auth import load_run_secret
from podrl.config import RunConfig
from podrl.config.auth import AuthConfig
from podrl.config.trainer import TrainerConfig
from podrl.trainer import checkpoint, export
from podrl.trainer.batch import (
    BatchLimits,
    ChunkKernels,
    HeadRequest,
    MicroBatch,
    collate,
    install_logprob_head,
    plain_logprobs,
    request_logprobs,
    share_totals,
    split_for_rank,
    validate_share,
)
from podrl.trainer.errors import NonFiniteStepError, StepAbortedError
from podrl.trainer.parallel import (
    RankEnv,
    compute_context,
    init_distributed,
    load_hf_model,
    parallelize,
    resolve_device,
    resolve_model_path,
    uses_fsdp,
)
from podrl.trainer.replication import CrossPodReplica, ReplicaStepError, parameters_digest
from podrl.v1 import trainer_pb2

log = logging.getLogger(__name__)

Cancelled = Callable[[], bool]
"""True once the caller of a running command gave up on it (rank 0's gRPC caller)."""


def never_cancelled() -> bool:
    """The cancellation of a command nobody can cancel (ranks > 0, direct calls)."""
    return False


# -- the train state and the LR schedule ---------------------------------------------------------


@dataclass(frozen=True)
class AppliedTrain:
    """The last Train this engine applied: its ``TrainRequest.batch_id`` ("" if it had none)
    and its reply, kept so that a retry of the same batch is answered without a second step."""

    batch_id: str
    response: trainer_pb2.TrainResponse


def _rng_text(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode("ascii")


def _rng_tensor(text: str) -> torch.Tensor:
    data = bytearray(base64.b64decode(text.encode("ascii")))
    return torch.frombuffer(data, dtype=torch.uint8).clone()


class TrainState:
    """The trainer's progress beside its model and optimizer, with one owner.

    The engine owns one per rank; only its methods change it. It holds the policy version (the
    number of optimizer steps applied: the trainer keeps no separate step counter), the last
    applied Train and its reply, the LR schedule and torch's RNG states. :meth:`state_dict` is
    what a checkpoint stores and a healing pod receives (``{"model", "optim", "train_state"}``,
    see ``TrainerEngine.state_dict``); it is JSON-ready (RNG states as base64), so the checkpoint
    writes it into ``trainer_state.json`` as it is.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler, device: torch.device):
        self.scheduler = scheduler
        self._device = device
        self.policy_version = 0
        self.last_train: AppliedTrain | None = None

    @property
    def learning_rate(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    def advance(self) -> int:
        """The optimizer just stepped: the schedule and the version move with it. The new
        version."""
        self.scheduler.step()
        self.policy_version += 1
        return self.policy_version

    def applied(self, batch_id: str, response: trainer_pb2.TrainResponse) -> None:
        """Remember the Train just applied, so a retry of ``batch_id`` gets ``response``."""
        self.last_train = AppliedTrain(batch_id, response)

    def state_dict(self) -> dict[str, Any]:
        """Version, schedule and RNG states (JSON-ready). The last reply is not in it: it
        belongs to this process's weights, not to the weights that load this state."""
        return {
            "policy_version": self.policy_version,
            "scheduler": self.scheduler.state_dict(),
            "rng_cpu": _rng_text(torch.get_rng_state()),
            "rng_cuda": [_rng_text(s) for s in torch.cuda.get_rng_state_all()]
            if self._device.type == "cuda"
            else [],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's or a peer pod's state. The stored reply is dropped: it belongs to
        weights that are gone, so a batch sent again now trains again."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.policy_version = int(state["policy_version"])
        self.last_train = None
        torch.set_rng_state(_rng_tensor(state["rng_cpu"]))
        if self._device.type == "cuda" and state["rng_cuda"]:
            states = [_rng_tensor(s) for s in state["rng_cuda"]]
            # Another machine may have another GPU count: its states do not map onto these.
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)


def lr_multiplier(config: TrainerConfig) -> Callable[[int], float]:
    """``step`` (optimizer steps already taken) → factor on ``config.lr``.

    warmup:  (step + 1) / warmup_steps            for step < warmup_steps
    then p = (step - warmup) / (total - warmup) clipped to [0, 1], floor = min_lr_ratio:
    constant: 1;  linear: floor + (1 - floor) * (1 - p);
    cosine: floor + (1 - floor) * (1 + cos(pi * p)) / 2
    """
    warmup, total, floor, shape = (
        config.warmup_steps,
        config.total_steps,
        config.min_lr_ratio,
        config.lr_schedule,
    )

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if shape == "constant":
            return 1.0
        progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
        if shape == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier


# -- the gradient norm and the update size -----------------------------------------------------
#
# ``torch.nn.utils.clip_grad_norm_`` stacks per-parameter norms, which fails when parameters live
# on different meshes (FSDP-only parameters on the dp mesh, FSDP+TP ones on the 2-D mesh). Here
# each gradient contributes the squared sum of its local shard; the sums are all-reduced over the
# mesh dimensions on which that gradient is sharded (never over replicated ones), then added.


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


# -- the step ----------------------------------------------------------------------------------

# Metric sums all-reduced over the data-parallel ranks, in this order.
_SUMS = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "ratio",
    "clipped",
    "tokens",
    "logprob_diff",
    "clipped_low",
    "clipped_high",
    "clipped_dual",
    "is_weight",
    "mismatch_kl",
    "masked",
    "truncated",
)
# Metric extremes all-reduced by MAX, in this order; minima travel negated (max of -x).
_PEAKS = ("logprob_diff_max", "ratio_max", "ratio_min", "is_weight_max", "is_weight_min")
_NEGATED_PEAKS = frozenset({"ratio_min", "is_weight_min"})


def _require_finite_step(loss: float, grad_norm: float, version: int) -> None:
    """Every rank computes the same reduced loss and global gradient norm, so every rank
    raises alike; the agreement then makes it all or nothing anyway."""
    bad = [
        f"{name} is {value}"
        for name, value in (("loss", loss), ("grad_norm", grad_norm))
        if not math.isfinite(value)
    ]
    if bad:
        raise NonFiniteStepError(
            f"the step to version {version + 1} is not finite ({', '.join(bad)}): no update "
            "was applied; check the batch (advantages, logprobs) and the learning rate"
        )


def _metrics(
    values: dict[str, float], peaks: list[float], grad_norm: float, lr: float
) -> trainer_pb2.TrainMetrics:
    """The step's TrainMetrics from the batch-wide sums of ``_SUMS`` and maxima of ``_PEAKS``
    (step_seconds and update_ratio unset)."""
    tokens = max(values["tokens"], 1.0)
    extremes = {}
    for name, value in zip(_PEAKS, peaks, strict=True):
        # A batch without completion tokens has no extremes (the reduction's -inf): report 0.
        extremes[name] = (
            (-value if name in _NEGATED_PEAKS else value) if math.isfinite(value) else 0.0
        )
    return trainer_pb2.TrainMetrics(
        loss=values["loss"],
        pg_loss=values["pg_loss"],
        kl=values["kl"],
        entropy=values["entropy"] / tokens,
        ratio_mean=values["ratio"] / tokens,
        clip_fraction=values["clipped"] / tokens,
        grad_norm=grad_norm,
        logprob_diff_mean=values["logprob_diff"] / tokens,
        logprob_diff_max=extremes["logprob_diff_max"],
        tokens=int(values["tokens"]),
        learning_rate=lr,
        clip_fraction_low=values["clipped_low"] / tokens,
        clip_fraction_high=values["clipped_high"] / tokens,
        clip_fraction_dual=values["clipped_dual"] / tokens,
        ratio_min=extremes["ratio_min"],
        ratio_max=extremes["ratio_max"],
        is_weight_mean=values["is_weight"] / tokens,
        is_weight_min=extremes["is_weight_min"],
        is_weight_max=extremes["is_weight_max"],
        is_masked_fraction=values["masked"] / tokens,
        is_truncated_fraction=values["truncated"] / tokens,
        mismatch_kl=values["mismatch_kl"] / tokens,
    )


class TrainerEngine:
    """See the module docstring. Build it on every rank with the same config
    (:meth:`build`); the constructor takes the trainer's section, the run's auth section and
    what was resolved from the rest of the run config."""

    @classmethod
    def build(cls, config: RunConfig, env: RankEnv | None = None) -> TrainerEngine:
        """This rank's engine: joins the trainer's process group, resolves the device (the
        run's ``device``) and the model folder, and takes the worker id as the pod's id."""
        env = env or RankEnv.from_environ()
        device = resolve_device(config, env)
        mesh = init_distributed(config, env, device)
        # Every rank resolves it; the tiny default is written atomically by whichever is first.
        model_path = resolve_model_path(config)
        return cls(
            config.trainer,
            auth=config.auth,
            env=env,
            device=device,
            mesh=mesh,
            model_path=model_path,
            worker_id=config.worker_id,
        )

    def __init__(
        self,
        settings: TrainerConfig,
        *,
        auth: AuthConfig,
        env: RankEnv,
        device: torch.device,
        mesh: DeviceMesh,
        model_path: Path,
        worker_id: str,
    ) -> None:
        self.settings = settings
        # The run secret is read when the pods' replica is built (the first replicated Train).
        self.auth = auth
        self.env = env
        self.device = device
        self.mesh = mesh
        self.model_path = model_path
        # The pod's id: its replica id across pods and the publisher id of its manifests.
        self.worker_id = worker_id
        # The ranks' vote before the optimizer step (``_agree``): CPU bytes on a group of its
        # own, waiting longer than a model collective so a rank stuck in one still gets here.
        self._agreement_group = (
            dist.new_group(
                backend="gloo",
                timeout=timedelta(seconds=2 * self.settings.collective_timeout_seconds),
            )
            if self.env.world_size > 1
            else None
        )
        torch.manual_seed(self.settings.seed)
        # Decided once: FSDP2 over the ranks, or the plain module of a one-rank trainer.
        self.fsdp = uses_fsdp(self.settings.fsdp, self.env.world_size)
        self._compute_context = compute_context(self.device, self.fsdp)
        compile_layers = self.settings.compile_layers
        if compile_layers is None:
            compile_layers = self.device.type == "cuda"
        self.model: PreTrainedModel = self._build_model(compile_layers, trainable=True)
        self.reference: PreTrainedModel | None = None
        if self.settings.kl_coef > 0:
            self.reference = self._build_model(compile_layers, trainable=False)
        self.logprob_kernels = ChunkKernels.make(compiled=compile_layers)
        hf_config = self.model.config
        self.limits = BatchLimits(
            vocab_size=hf_config.vocab_size,
            max_positions=getattr(hf_config, "max_position_embeddings", 1 << 30),
        )
        pad = getattr(hf_config, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else 0
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.settings.lr,
            betas=(self.settings.adam_beta1, self.settings.adam_beta2),
            eps=self.settings.adam_eps,
            weight_decay=self.settings.weight_decay,
            **self._adamw_implementation(),
        )
        # Version, last reply, schedule and RNG: changed only through this object's methods.
        self.train_state = TrainState(
            torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_multiplier(self.settings)),
            self.device,
        )
        self.loss_settings = LossSettings(
            mode=self.settings.loss_mode,
            clip_eps_low=self.settings.clip_eps_low,
            clip_eps_high=self.settings.clip_eps_high,
            kl_coef=self.settings.kl_coef,
            dr_grpo_max_tokens=self.settings.dr_grpo_max_tokens,
            clip_ratio_c=self.settings.clip_ratio_c,
            correction=self.settings.off_policy.correction,
            is_cap=self.settings.off_policy.is_cap,
            mask=self.settings.off_policy.mask,
            mask_low=self.settings.off_policy.mask_low,
            mask_high=self.settings.off_policy.mask_high,
        )
        # Checks that may refuse a step before any rank starts it (e.g. weights published from
        # the live GPU parameters and not yet acknowledged): each raises TrainNotAllowedError.
        self.train_gates: list[Callable[[], None]] = []
        # Data parallelism across pods (podrl.trainer.replication): decided here, once, so a
        # step reads a flag instead of the config; the replica itself is built by the first Train
        # of more than one pod.
        self.replicated = settings.replication.enabled
        self.replica: CrossPodReplica | None = None
        log.info(
            "trainer rank %d/%d: %s on %s, mesh %s",
            self.env.rank,
            self.env.world_size,
            self.model_path,
            self.device,
            dict(zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True)),
        )

    # -- facts ---------------------------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp_shard"].get_local_rank()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp_shard"].size()

    @property
    def policy_version(self) -> int:
        """The number of optimizer steps applied to these weights (``train_state``'s)."""
        return self.train_state.policy_version

    @property
    def last_train(self) -> AppliedTrain | None:
        return self.train_state.last_train

    @property
    def learning_rate(self) -> float:
        return self.train_state.learning_rate

    def validate(self, request: trainer_pb2.TrainRequest) -> None:
        """Raise BatchError if ``request`` must not be trained on, TrainNotAllowedError if the
        trainer may not step now (rank 0, before broadcast). Replicated, the batch is checked
        inside the step instead (after a heal, the version is the peers'): see
        :meth:`check_gates`."""
        validate_share(request, self.policy_version, self.limits, self.replicated)
        self.check_gates()

    def check_gates(self) -> None:
        """Raise TrainNotAllowedError if the trainer may not step now."""
        for gate in self.train_gates:
            gate()

    # -- model and optimizer construction -----------------------------------------------------

    def _build_model(self, compile_layers: bool, trainable: bool) -> PreTrainedModel:
        model = parallelize(
            load_hf_model(self.model_path, self.settings.attn_implementation),
            self.mesh,
            self.device,
            trainable=trainable,
            compile_layers=compile_layers,
            activation_checkpointing=self.settings.activation_checkpointing,
            fsdp=self.fsdp,
        )
        if self.settings.fused_logprobs:
            install_logprob_head(model)
        return model

    def _adamw_implementation(self) -> dict[str, bool]:
        """AdamW's ``fused``/``foreach`` arguments for ``trainer.optimizer_impl``."""
        impl = self.settings.optimizer_impl
        if impl == "auto":
            # Fused AdamW takes one kernel for all parameters. With TP the parameters live on
            # two meshes (dp, and dp x tp); fused and foreach were not measured on that mix, so
            # auto keeps torch's default there. On CPU torch's default is the for-loop, a few
            # DTensor ops per parameter: foreach groups them (docs/performance.md).
            if self.settings.tp != 1:
                impl = "default"
            else:
                impl = "fused" if self.device.type == "cuda" else "foreach"
        return {
            "fused": {"fused": True},
            "foreach": {"foreach": True},
            "for_loop": {"foreach": False},
        }.get(impl, {})

    # -- forward -------------------------------------------------------------------------------

    def _token_logprobs(
        self, model: PreTrainedModel, batch: MicroBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprob of each completion token, entropy of its distribution): ``[B, L-1]`` each,
        0 at prompt and padding positions; the entropy carries no gradient."""
        temperature = self.settings.logit_temperature
        if self.settings.fused_logprobs:
            request = HeadRequest(
                batch.token_index,
                batch.token_targets,
                temperature,
                self.settings.logprob_chunk_tokens,
                self.logprob_kernels,
            )
            with request_logprobs(model, request), self._compute_context():
                logprobs = model(**batch.model_inputs()).logits
            entropy = request.entropy
        else:
            with self._compute_context():
                logits = model(**batch.model_inputs()).logits
            selected = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.token_index)
            logprobs, entropy = plain_logprobs(selected, batch.token_targets, temperature)
        return batch.to_rows(logprobs), batch.to_rows(entropy)

    # -- the step ------------------------------------------------------------------------------

    def train_step(
        self, request: trainer_pb2.TrainRequest, cancelled: Cancelled = never_cancelled
    ) -> trainer_pb2.TrainResponse:
        """One optimizer step on the whole batch (every rank, same request) → metrics.

        All or nothing over every rank of the trainer's world:

        1. every rank computes its gradients and metric sums (no step yet);
        2. the ranks agree (:meth:`_agree`) that all of them did; if one failed, no rank steps,
           gradients are dropped and :class:`StepAbortedError` is raised on every rank;
        3. every collective of the step (metric sums, the global gradient norm) runs, and the
           ranks agree once more;
        4. ``optimizer.step``, ``scheduler.step`` and the version bump run together, with no
           collective between them: the step is now applied on every rank. A failure in the
           bookkeeping after it is logged and does not undo or hide the applied step.

        Across pods (``trainer.replication``, :mod:`podrl.trainer.replication`), the pod is one
        torchft replica group: before 1 the step's quorum of pods forms (a pod behind the others
        heals from one first; a pod that trains the step alone forms none) and the request is
        checked; in 3 the vote, the metric sums and
        the gradients are summed over the pods before clipping; before 4 torchft's commit vote
        runs, and a failed one raises :class:`StepAbortedError` with nothing stepped. A step
        waiting for its quorum gives up once ``cancelled()`` is True on rank 0 (the caller
        cancelled the Train).
        """
        started = time.monotonic()
        replica = self._join_pods(request, cancelled) if self.replicated else None
        version = self.policy_version
        lr = self.learning_rate
        # A failed earlier attempt may have left gradients behind: never add them to this step.
        self.optimizer.zero_grad(set_to_none=True)
        failure: BaseException | None = None
        try:
            sums, peaks = self._forward_backward(request)
        except Exception as err:  # reported through the agreement, then raised on every rank
            failure = err
        try:
            self._agree(failure, version, "computing its gradients")
            try:
                dp_group = self.mesh["dp_shard"].get_group()
                if self.dp_size > 1:
                    dist.all_reduce(sums, group=dp_group)
                    dist.all_reduce(peaks, op=dist.ReduceOp.MAX, group=dp_group)
                if replica is not None:  # the other pods' parts: sums and gradients add up
                    sums, peaks = replica.exchange(sums, peaks, self.model.parameters(), version)
                norm = clip_grad_norm(self.model.parameters(), self.settings.grad_clip)
                # The host reads the step's figures once: one device-to-host copy (on CUDA one
                # synchronisation) for the gradient norm, the metric sums and the maxima.
                grad_norm, *host = torch.cat(
                    [norm.reshape(1).to(sums.device, sums.dtype), sums, peaks]
                ).tolist()
                host_sums, host_peaks = host[: len(_SUMS)], host[len(_SUMS) :]
                # NaN/inf never reach the weights (a 3e38 advantage once made every one NaN).
                _require_finite_step(host_sums[0], grad_norm, version)
                # For the update size; taken before the vote, so a rank short of memory for
                # the copy aborts the step on every rank instead of stepping alone.
                before = snapshot_parameters(self.model.parameters())
                if faults.ARMED:
                    faults.hit("trainer.before_optimizer_step", rank=self.env.rank, version=version)
            except Exception as err:
                failure = err
            self._agree(failure, version, "reducing metrics and gradients")
        except StepAbortedError as aborted:
            if replica is not None:  # peers waiting for this pod's vote hear that it failed
                replica.abort(aborted)
            raise
        if replica is not None and not replica.commit():
            self.optimizer.zero_grad(set_to_none=True)
            raise StepAbortedError(
                f"the cross-pod commit of version {version + 1} failed (a peer pod left or a "
                f"cross-pod operation broke); version {version} is unchanged on this pod"
            )
        metrics = _metrics(dict(zip(_SUMS, host_sums, strict=True)), host_peaks, grad_norm, lr)
        # The commit: from here to the version bump nothing may fail between ranks.
        self.optimizer.step()
        new_version = self.train_state.advance()
        # ``step`` is the version: the trainer counts one number (the field stays on the wire).
        response = trainer_pb2.TrainResponse(
            metrics=metrics, policy_version=new_version, step=new_version
        )
        try:
            # First: a collective every rank reaches (a fault below hits one rank only).
            response.metrics.update_ratio = update_ratio(self.model.parameters(), before)
            del before
            if faults.ARMED:
                faults.hit("trainer.after_optimizer_step", rank=self.env.rank, version=new_version)
            self.optimizer.zero_grad(set_to_none=True)
        except Exception:
            # The weights are those of the new version on every rank: report the step as
            # applied (the controller must not train on this batch again).
            log.exception(
                "rank %d: error after the optimizer step of version %d (the step is applied)",
                self.env.rank,
                new_version,
            )
        response.metrics.step_seconds = time.monotonic() - started
        self.train_state.applied(request.batch_id, response)
        return response

    def _join_pods(
        self, request: trainer_pb2.TrainRequest, cancelled: Cancelled
    ) -> CrossPodReplica | None:
        """Every rank: this step's quorum of pods, a heal if this pod is behind, then the
        batch check; raises BatchError or StepAbortedError (nothing stepped). None for a step
        that this pod trains alone (``pods`` 1, ``pod_ids`` this pod or empty): a quorum of one
        pod heals nothing and sums nothing, so the step asks the Lighthouse nothing and only
        the batch is checked. A newcomer still heals: the controller sends it and this pod a
        step of 2 pods, and both join its quorum (the torchft manager is built then)."""
        if request.pods == 1 and set(request.pod_ids) <= {self.worker_id}:
            validate_share(request, self.policy_version, self.limits, True)
            return None
        if self.replica is None:
            self.replica = CrossPodReplica(
                self.settings.replication,
                replica_id=self.worker_id,
                advertise_host=self.settings.advertise_host,
                pod_group=self._agreement_group,
                metric_count=len(_SUMS),
                env=self.env,
                device=self.device,
                layout=self._layout(),
                state_dict=self.state_dict,
                load_state_dict=self.load_state_dict,
                # The replica id carries its MAC (the Lighthouse's front checks it).
                secret=load_run_secret(self.auth),
            )
        try:
            # The version is read when called: a heal inside begin changes it.
            self.replica.begin(
                request,
                version=lambda: self.policy_version,
                check=lambda: validate_share(request, self.policy_version, self.limits, True),
                cancelled=cancelled,
            )
        except ReplicaStepError as err:
            raise StepAbortedError(
                f"{err} (policy version {self.policy_version} on this pod)"
            ) from err
        return self.replica

    def _forward_backward(
        self, request: trainer_pb2.TrainRequest
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's forward and backward passes over its share of the batch: gradients
        accumulate in the parameters; the metric sums ``_SUMS`` and maxima ``_PEAKS`` of this
        rank are returned (not yet reduced over ranks)."""
        sequences = list(request.sequences)
        # The whole batch's counts: a pod's share divides by them too (its gradient is a part).
        totals = share_totals(request)
        micro_batches = split_for_rank(
            sequences,
            self.dp_rank,
            self.dp_size,
            self.settings.micro_batch_size,
            self.settings.micro_batch_tokens,
            packed=self.settings.packing,
        )
        self.model.train()
        sums = torch.zeros(len(_SUMS), dtype=torch.float64, device=self.device)
        peaks = torch.full((len(_PEAKS),), -math.inf, dtype=torch.float64, device=self.device)
        # Every micro-batch goes to the device before the first forward: a copy from pageable
        # host memory issued between micro-batches can wait for the previous backward.
        batches = [
            collate(
                part,
                self.pad_id,
                packed=self.settings.packing,
                attention_mask=self.settings.attn_implementation != "sdpa",
            ).to(self.device)
            for part in micro_batches
        ]
        for index, batch in enumerate(batches):
            if self.fsdp:
                self.model.set_requires_gradient_sync(index == len(batches) - 1)
            logprobs, entropy = self._token_logprobs(self.model, batch)
            ref_logprobs = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_logprobs, _ = self._token_logprobs(self.reference, batch)
            terms = policy_loss(
                logprobs,
                batch.generator_logprobs,
                batch.advantages,
                batch.loss_mask,
                self.loss_settings,
                totals,
                ref_logprobs,
            )
            # FSDP averages gradients over dp ranks; the loss is already a batch-wide sum.
            (terms.loss * self.dp_size).backward()
            with torch.no_grad():
                mask = batch.loss_mask
                diff = (logprobs.detach() - batch.generator_logprobs).abs() * mask
                sums += torch.stack(
                    [
                        terms.loss.detach(),
                        terms.pg_loss,
                        terms.kl,
                        (entropy * mask).sum(),
                        terms.ratio_sum,
                        terms.clipped_tokens,
                        terms.tokens,
                        diff.sum(),
                        terms.clipped_low,
                        terms.clipped_high,
                        terms.clipped_dual,
                        terms.weight_sum,
                        terms.mismatch_kl_sum,
                        terms.masked_tokens,
                        terms.truncated_tokens,
                    ]
                ).to(torch.float64)
                step_peaks = torch.stack(
                    [
                        diff.max(),
                        terms.ratio_max,
                        -terms.ratio_min,
                        terms.weight_max,
                        -terms.weight_min,
                    ]
                ).to(torch.float64)
                peaks = torch.maximum(peaks, step_peaks)
            del logprobs, entropy, terms
        return sums, peaks

    def _agree(self, failure: BaseException | None, version: int, phase: str) -> None:
        """Every rank: go on only if no rank failed ``phase``; otherwise drop the gradients and
        raise StepAbortedError on every rank (nothing was stepped).

        The vote travels over the engine's own gloo group, apart from the model's collectives:
        a rank that failed inside one of those still meets the others here once they time out.
        """
        failed = torch.zeros(self.env.world_size, dtype=torch.int32)
        failed[self.env.rank] = int(failure is not None)
        if self._agreement_group is not None:
            dist.all_reduce(failed, group=self._agreement_group)
        ranks = [rank for rank, bad in enumerate(failed.tolist()) if bad]
        if not ranks:
            return
        self.optimizer.zero_grad(set_to_none=True)
        if failure is not None:
            log.error(
                "rank %d failed %s for version %d",
                self.env.rank,
                phase,
                version + 1,
                exc_info=failure,
            )
        if isinstance(failure, NonFiniteStepError):
            raise NonFiniteStepError(
                f"{failure} (trainer rank(s) {ranks}; policy version {version} is unchanged on "
                "every rank)"
            ) from failure
        own = f" (rank {self.env.rank}: {type(failure).__name__}: {failure})" if failure else ""
        raise StepAbortedError(
            f"trainer rank(s) {ranks} failed {phase}{own}; no rank stepped, the weights, the "
            f"optimizer and policy version {version} are unchanged on every rank"
        ) from failure

    # -- state, checkpoints and export ---------------------------------------------------------

    def _layout(self) -> dict[str, object]:
        """What a peer pod's state must match to load here shard by shard (a heal)."""
        return {
            "mesh": dict(zip(self.mesh.mesh_dim_names, self.mesh.shape, strict=True)),
            "rank": self.env.rank,
            "parameters": sum(1 for _ in self.model.parameters()),
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: ``model`` and ``optim`` (this rank's shards, DTensors) and
        ``train_state`` (:class:`TrainState`). What a checkpoint saves and a healing pod gets."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_state,
            "optim": optim_state,
            "train_state": self.train_state.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a state of :meth:`state_dict`'s shape (model and optimizer state dicts as
        ``set_state_dict`` takes them)."""
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.optimizer.zero_grad(set_to_none=True)
        self.train_state.load_state_dict(state["train_state"])

    def save_checkpoint(self, path: Path, controller_state: bytes = b"") -> None:
        checkpoint.save(
            self,
            Path(path),
            rank=self.env.rank,
            world_size=self.env.world_size,
            model_path=self.model_path,
            controller_state=controller_state,
        )

    def load_checkpoint(self, path: Path) -> bytes:
        """Restore everything saved at ``path``; the controller's blob."""
        return checkpoint.load(self, Path(path))

    def export_hf(self, path: Path) -> list[str]:
        """Write a Hugging Face safetensors folder (rank 0 writes; every rank must call)."""
        return export.export_hf(self.model, self.model_path, Path(path), self.env.rank)

    def parameters_digest(self) -> str:
        """Every rank (a collective): sha256 of the full parameters (rank 0; "" elsewhere)."""
        # A forward without backward leaves FSDP2's root unsharded: digest the sharded ones.
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        return parameters_digest(self.model)

    def close(self) -> None:
        if self.replica is not None:
            self.replica.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
