"""Data parallelism across worker pods: every pod's trainer is one torchft replica group.

With ``trainer.replication.lighthouse_address`` set, each Train of a step that more than one
pod trains is one step of a torchft ``Manager`` (docs/scaling.md, "Trainers across pods"; a pod
that trains a step alone, ``pods`` 1, forms no quorum: ``TrainerEngine._join_pods``); inside
the pod FSDP2/TP run as before, and the pod's ranks 0..n-1 are the replica group's ranks (rank
r of every pod exchanges with rank r of the others, over a process group that torchft rebuilds
when the quorum changes: gloo on CPU, NCCL on CUDA). One step:

1. **join** (:meth:`CrossPodReplica.begin`): the Lighthouse forms a quorum of the pods that ask;
   a pod behind the most advanced one (a new pod at version 0, one whose last step did not
   commit) **heals** first: it fetches a peer's trainer state, the dict a checkpoint saves
   (parameters, optimizer state and the train state: policy version, schedule, RNG; torchft's
   HTTP checkpoint transport), so its version check sees the peers' version. Then the pods add
   up what they hold: their shares must make up the request's batch (``global_sequences``,
   ``global_completion_tokens``) and their number must be ``TrainRequest.pods``. A quorum that
   misses a pod (torchft forms a quorum as soon as the previous one's members are back, before a
   newcomer's request arrives) is formed again, until ``quorum_timeout_seconds``. A pod that
   refuses its share (INVALID_ARGUMENT) says so here, once the quorum is complete, and every
   other pod aborts too.
2. forward/backward on the pod's share, with the batch-wide totals as the loss's
   denominators (so per-pod gradients are parts of one sum);
3. **exchange** (:meth:`CrossPodReplica.exchange`): a vote (did every pod compute its
   gradients?) carrying the metric sums, then the SUM of every gradient over the pods (torchft
   averages by default; podrl's losses are already batch-wide sums). Clipping then sees the
   whole batch's gradient;
4. **commit** (:meth:`CrossPodReplica.commit`): torchft's ``should_commit``: no rank of this pod
   saw an error in any cross-pod operation. Only then do the optimizer, the schedule and the
   version move. Otherwise nothing changed on this pod and Train answers ABORTED.

A pod that dies mid-step breaks the exchange of the others: they answer ABORTED with nothing
changed, and the controller sends that step's batch again, split over the pods left.

The Manager starts with the first Train of more than one pod, not with the trainer: a pod
that runs but was never sent one does not heartbeat to the Lighthouse, so it cannot hold up
others' quorums.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map_only, tree_unflatten

from podrl.common import faults
from podrl.common.auth import RunSecret
from podrl.common.processes import free_ports
from podrl.config import ConfigError
from podrl.config.trainer import ReplicationConfig
from podrl.trainer.batch import BatchError, trained_tokens
from podrl.trainer.lighthouse_front import signed_replica_id
from podrl.trainer.parallel import RankEnv
from podrl.v1 import trainer_pb2

log = logging.getLogger(__name__)


class ReplicaStepError(RuntimeError):
    """This step cannot be trained across the pods (a peer failed or refused, the quorum
    never held the step's pods, a cross-pod operation failed); nothing was stepped on this
    pod (the engine raises it as StepAbortedError → ABORTED)."""


class UnadmittedReplicaError(ReplicaStepError):
    """The quorum holds a replica of a pod that this step's request does not name."""


class ReplicaStateError(RuntimeError):
    """A peer's state cannot be loaded here (another mesh or model); the message says which."""


# -- digests ---------------------------------------------------------------------------------


@torch.no_grad()
def parameters_digest(model: torch.nn.Module) -> str:
    """Every rank (a collective): hex sha256 over each parameter in name order, its name, shape
    and full tensor as float32 bytes; meaningful on rank 0 (the others return "")."""
    digest = hashlib.sha256()
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        if rank == 0:
            full = full.detach().to("cpu", torch.float32).contiguous()
            digest.update(f"{name}{tuple(full.shape)}".encode())
            digest.update(full.numpy().tobytes())
    return digest.hexdigest() if rank == 0 else ""


# -- the replica -----------------------------------------------------------------------------


def replica_pod(replica_id: str) -> str:
    """The pod a torchft replica id names: what precedes its first ``:`` (as torchft reads it;
    the id is ``lighthouse_front.signed_replica_id``'s). Here, beside its one caller: a step's
    quorum check runs it, so the step needs no code of the Lighthouse's front."""
    return replica_id.split(":", 1)[0]


def _lighthouse_url(address: str) -> str:
    return address if "://" in address else f"http://{address}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _checkpoint_transport(advertise_host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport, advertised at ``advertise_host``: torchft's own
    names the machine's hostname, which other pods of a StatefulSet cannot resolve."""
    from torchft.checkpointing import HTTPTransport

    class AdvertisedHTTPTransport(HTTPTransport):
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{_url_host(advertise_host)}:{port}/checkpoint/"

    return AdvertisedHTTPTransport(timeout=timeout, num_chunks=0)


def cross_pod_backend(configured: str, device: torch.device) -> str:
    """``trainer.replication.backend`` resolved for this trainer's parameters: ``auto`` is NCCL
    for CUDA ones and gloo for CPU ones. gloo reduces CUDA tensors too (torchft registers it
    for both device types), which pods sharing one GPU need: NCCL allows one rank per GPU.
    The load-time rule refuses nccl with ``device: cpu``; this catches ``device: auto`` on a
    machine where torch sees no GPU, which only the trainer's process can know."""
    if configured == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if configured == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"trainer.replication.backend: nccl needs CUDA parameters, these are on "
            f"{device.type}; set it to gloo or auto, or device: cuda"
        )
    return configured


def _process_group(backend: str, timeout: timedelta) -> Any:
    """torchft's reconfigurable cross-pod process group of ``backend`` (nccl or gloo)."""
    from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

    if backend == "nccl":
        return ProcessGroupNCCL(timeout=timeout)
    return ProcessGroupGloo(timeout=timeout)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class CrossPodReplica:
    """This pod's trainer as one torchft replica group; built on every rank of the pod (with
    the same arguments, at the same point: the first Train of more than one pod).

    ``state_dict``/``load_state_dict`` are the trainer's (torchft's callbacks): the state a
    healing peer fetches and the one this pod takes when it heals, ``{"model", "optim",
    "train_state"}``; ``layout`` is what a peer's state must match to load shard by shard."""

    def __init__(
        self,
        settings: ReplicationConfig,
        *,
        replica_id: str,
        advertise_host: str,
        pod_group: dist.ProcessGroup | None,
        metric_count: int,
        env: RankEnv,
        device: torch.device,
        layout: dict[str, object],
        state_dict: Callable[[], dict[str, Any]],
        load_state_dict: Callable[[dict[str, Any]], None],
        secret: RunSecret | None = None,
    ) -> None:
        from torchft.manager import Manager

        self.settings = settings
        self.replica_id = replica_id
        self._pod_group = pod_group
        self._metric_count = metric_count
        self._env = env
        self._device = device
        self._layout = layout
        self._trainer_state = state_dict
        self._load_trainer_state = load_state_dict
        timeout = timedelta(seconds=settings.collective_timeout_seconds)
        self._timeout = timeout
        self._store = None
        store_port, manager_port = self._start_store(advertise_host)
        # The Lighthouse's front admits a replica id only with the run secret's MAC over the
        # pod and the addresses torchft sends with it (podrl.trainer.lighthouse_front).
        torchft_id = signed_replica_id(
            secret, replica_id, f"http://{advertise_host}:{manager_port}",
            f"{advertise_host}:{store_port}",
        )  # fmt: skip
        self.manager = Manager(
            pg=_process_group(cross_pod_backend(settings.backend, device), timeout),
            load_state_dict=self._load_state,
            state_dict=self._state,
            min_replica_size=1,
            # The quorum (and a heal) completes before the step's forward: a healing pod must
            # hold the peers' weights and version before its version check.
            use_async_quorum=False,
            # Pods at version 0 all load the same model file: nothing to copy at the start.
            init_sync=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout_seconds),
            connect_timeout=timedelta(seconds=settings.connect_timeout_seconds),
            rank=env.rank,
            world_size=env.world_size,
            store_addr=advertise_host,
            store_port=store_port,
            lighthouse_addr=_lighthouse_url(settings.lighthouse_address),
            replica_id=torchft_id,
            port=manager_port,
            hostname=advertise_host,
            checkpoint_transport=_checkpoint_transport(advertise_host, timeout),
        )
        # Every quorum is checked before torchft heals from a peer or builds a process group.
        self.manager._client = _AdmittingClient(self.manager._client, self._check_participants)
        # This step's pods (TrainRequest.pod_ids; empty: not checked).
        self._step_pods: frozenset[str] = frozenset()
        # Per step: did this pod's quorum form, did it take part in the gradient vote.
        self._in_quorum = False
        self._voted = False
        log.info(
            "trainer rank %d: replica %r of the pods at %s (store %s:%d)",
            env.rank,
            replica_id,
            settings.lighthouse_address,
            advertise_host,
            store_port,
        )

    def _start_store(self, advertise_host: str) -> tuple[int, int]:
        """The TCPStore where pods rendezvous for the cross-pod process group: served by rank 0
        on every interface; its port and that of rank 0's torchft manager server (chosen here:
        the replica id's MAC covers the manager's address) told to the pod's other ranks."""
        ports = torch.zeros(2, dtype=torch.int64)
        if self._env.rank == 0:
            self._store = dist.TCPStore(
                host_name=advertise_host,
                port=self.settings.store_port,
                is_master=True,
                wait_for_workers=False,
            )
            ports[0] = self._store.port
            ports[1] = self.settings.manager_port or free_ports(1, "0.0.0.0")[0]
        if self._pod_group is not None:
            dist.broadcast(ports, src=0, group=self._pod_group)
        return int(ports[0].item()), int(ports[1].item())

    def _check_participants(self, replica_ids: list[str]) -> None:
        """Raise UnadmittedReplicaError if a quorum participant is not one of this step's
        pods: the Lighthouse's front admits only the run's trainers, and this keeps a pod from
        healing from, or training with, any other replica all the same."""
        unknown = sorted({replica_pod(r) for r in replica_ids} - self._step_pods)
        if self._step_pods and unknown:
            raise UnadmittedReplicaError(
                f"the quorum holds a replica of pod(s) {', '.join(map(repr, unknown))}, which "
                f"this step's request does not name (TrainRequest.pod_ids: "
                f"{', '.join(sorted(self._step_pods))}); this pod neither heals from nor trains "
                "with it"
            )

    def _pod_any(self, flag: bool) -> bool:
        """Every rank of the pod: True if ``flag`` is True on any of them."""
        if self._pod_group is None:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self._pod_group)
        return bool(value.item())

    # -- state a healing pod fetches -------------------------------------------------------------

    def _state(self) -> dict[str, object]:
        """This rank's trainer state with its shards as plain tensors, and its layout.
        torchft serves it to a healing peer's rank of the same number."""
        return {"layout": self._layout, **tree_map_only(DTensor, _local, self._trainer_state())}

    def _load_state(self, state: dict[str, Any]) -> None:
        """Take a peer's state (a heal): every tensor is copied into this rank's own shard."""
        if state["layout"] != self._layout:
            raise ReplicaStateError(
                f"a peer pod's trainer has layout {state['layout']}, this one "
                f"{self._layout}; every pod needs the same model and trainer.dp_shard/tp"
            )
        mine = self._trainer_state()
        filled = _copy_into(
            {"model": mine["model"], "optim": mine["optim"]},
            {"model": state["model"], "optim": state["optim"]},
        )
        self._load_trainer_state({**filled, "train_state": state["train_state"]})
        log.info(
            "trainer rank %d healed from a peer pod: version %d -> %d",
            self._env.rank,
            mine["train_state"]["policy_version"],
            state["train_state"]["policy_version"],
        )

    # -- one step ------------------------------------------------------------------------------

    def _start_quorum(self, version: int, deadline: float) -> BaseException | None:
        manager = self.manager
        # torchft's step is the policy version: the quorum heals every pod behind the highest.
        manager.load_state_dict({"step": version, "batches_committed": manager.batches_committed()})
        remaining = max(deadline - time.monotonic(), 1.0)
        try:
            manager.start_quorum(timeout=timedelta(seconds=remaining))
        except Exception as err:
            # torchft 0.2.0 re-raises a failed quorum at the start of the next one: forget it.
            manager._quorum_future = None
            return err
        self._in_quorum = True
        return manager.errored()

    def _alone(self) -> bool:
        """True when this pod is the only participant of the step's quorum: a SUM or MAX over
        the pods is then the pod's own value, and no cross-pod collective runs (each was a
        gloo round trip through torchft, about a sixth of a one-pod CPU demo step)."""
        manager = self.manager
        return manager.num_participants() == 1 and manager.is_participating()

    def _allreduce(self, tensors: list[torch.Tensor], op: dist.ReduceOp) -> BaseException | None:
        """All-reduce ``tensors`` over the quorum's pods (in place); the error if one failed
        (the tensors then hold garbage)."""
        if self._alone():
            return self.manager.errored()
        works = [self.manager.allreduce(tensor, reduce_op=op) for tensor in tensors]
        for work in works:
            work.wait()
        return self.manager.errored()

    def begin(
        self,
        request: trainer_pb2.TrainRequest,
        *,
        version: Callable[[], int],
        check: Callable[[], None],
        cancelled: Callable[[], bool],
    ) -> None:
        """Every rank: join this step's quorum (healing first if behind: ``version()`` is
        the trainer's version at each attempt), then check the request with ``check`` (which
        raises BatchError) and that the quorum holds exactly the step's pods. While the
        quorum misses pods, ``cancelled()`` on any rank (rank 0's caller cancelled the Train)
        ends the wait. Raises BatchError (this pod refuses its share) or ReplicaStepError;
        either way nothing was stepped."""
        self._in_quorum = self._voted = False
        self._step_pods = frozenset(request.pod_ids)
        started = time.monotonic()
        deadline = started + self.settings.quorum_timeout_seconds
        sequences = len(request.sequences)
        tokens = sum(trained_tokens(s) for s in request.sequences)
        expected = (
            float(request.global_sequences or sequences),
            float(request.global_completion_tokens or tokens),
            float(request.pods),
        )
        pause = self.settings.quorum_retry_seconds
        attempt = 0
        # The last quorum refused for a replica of another pod: a later failure (the quorum
        # call timing out) is most likely still that replica's doing.
        stranger: BaseException | None = None
        while True:
            attempt += 1
            failure = self._start_quorum(version(), deadline)
            refusal: BatchError | None = None
            # No rank healed or built a process group from this quorum: form it again.
            if self._pod_any(isinstance(failure, UnadmittedReplicaError)):
                stranger = failure or stranger
                if time.monotonic() + pause > deadline:
                    raise ReplicaStepError(
                        f"{failure or 'another rank saw a replica of a pod not in this step'}, "
                        f"after {attempt} attempts in "
                        f"{self.settings.quorum_timeout_seconds:.0f} s; no pod stepped"
                    )
                log.warning("%s: forming the quorum again", failure or "an unknown replica")
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
                continue
            if failure is None:
                try:
                    check()
                except BatchError as err:
                    refusal = err
                # What the quorum's pods hold and expect, summed over them.
                counts = torch.tensor(
                    [sequences, tokens, 1, int(refusal is not None), *expected],
                    dtype=torch.float64,
                    device=self._device,
                )
                failure = self._allreduce([counts], dist.ReduceOp.SUM)
            if self._pod_any(failure is not None):
                self.close(f"joining the step's quorum failed: {failure}")
                raise ReplicaStepError(
                    f"pod {self.replica_id} could not join the quorum of this step's pods "
                    f"({type(failure).__name__ if failure else 'another rank'}: {failure}"
                    + (f"; before that, {stranger}" if stranger else "")
                    + "); nothing was stepped"
                ) from failure
            held_sequences, held_tokens, pods, refused, *claimed = counts.tolist()
            if [c / pods for c in claimed] != list(expected):
                self.close("the pods disagree on the batch")
                raise ReplicaStepError(
                    "the pods of this step's quorum were sent different batch totals or pod "
                    f"counts (this pod: global_sequences {int(expected[0])}, "
                    f"global_completion_tokens {int(expected[1])}, pods {int(expected[2])}); "
                    "no pod stepped"
                )
            complete = (held_sequences, held_tokens) == expected[:2] and (
                not request.pods or pods == request.pods
            )
            if request.pods and pods == request.pods and not complete:
                # Every pod the request names is here, and their shares still do not make up
                # the totals: no quorum ever will. Every pod sees the same sums and refuses.
                self.close("the shares do not make up the batch's totals")
                raise BatchError(
                    f"global_sequences, global_completion_tokens: the {int(pods)} pods of this "
                    f"step hold {int(held_sequences)} sequences and {int(held_tokens)} "
                    f"completion tokens, the request names {int(expected[0])} and "
                    f"{int(expected[1])}; send each pod its share with the whole batch's counts"
                )
            # A refusal counts only in the complete quorum: a pod that gave up in a partial one
            # would leave the pods not yet in it waiting for it until their timeout.
            if complete and refused:
                self.close("a pod refused its share")
                if refusal is not None:
                    raise refusal
                raise ReplicaStepError(
                    f"{int(refused)} other pod(s) of this step refused their share "
                    "(INVALID_ARGUMENT there); no pod stepped"
                )
            if complete:
                if attempt > 1:
                    log.info(
                        "quorum of %d pod(s) after %d attempts (%.1f s)",
                        int(pods),
                        attempt,
                        time.monotonic() - started,
                    )
                return
            missing = (
                f"the quorum has {int(pods)} pod(s) holding {int(held_sequences)} of the "
                f"batch's {int(expected[0])} sequences ({int(held_tokens)} of "
                f"{int(expected[1])} completion tokens)"
                + (f", the request names {request.pods} pods" if request.pods else "")
            )
            # The controller cancels the call when a pod of the step is lost: the quorum
            # cannot hold the step without that pod's share, so waiting longer is pointless.
            if self._pod_any(cancelled()):
                self.close("the controller cancelled this Train")
                raise ReplicaStepError(
                    f"{missing}, and the controller cancelled this Train (a pod of the step "
                    "was lost); no pod stepped"
                )
            if time.monotonic() + pause > deadline:
                self.close("the quorum never held the step's pods")
                if refusal is not None:
                    raise refusal
                raise ReplicaStepError(
                    f"{missing} after {attempt} attempts in "
                    f"{self.settings.quorum_timeout_seconds:.0f} s "
                    "(trainer.replication.quorum_timeout_seconds): the other pods were not sent "
                    "their share, or are down; no pod stepped"
                )
            log.info("%s: forming the quorum again", missing)
            time.sleep(pause)
            pause = min(2 * pause, 1.0)

    def exchange(
        self,
        sums: torch.Tensor,
        peaks: torch.Tensor,
        parameters: Iterable[torch.nn.Parameter],
        version: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank, after the pod's own reductions: the vote and the metric sums, the
        metric maxima ``peaks`` (MAX), then the SUM of every gradient over the pods. Raises
        ReplicaStepError if a pod failed or a cross-pod operation broke."""
        if faults.ARMED:
            faults.hit("trainer.before_cross_pod_allreduce", rank=self._env.rank, version=version)
        self._voted = True
        vote = torch.cat([sums.new_zeros(1), sums])
        error = self._allreduce([vote], dist.ReduceOp.SUM)
        if error is None and vote[0] > 0:
            raise ReplicaStepError(
                f"{int(vote[0])} other pod(s) failed computing their gradients of version "
                f"{version + 1}; no pod stepped"
            )
        if error is None:
            error = self._allreduce([peaks], dist.ReduceOp.MAX)
        if error is None:
            error = self._reduce_gradients(list(parameters))
        if error is not None:
            raise ReplicaStepError(
                f"the cross-pod exchange of version {version + 1} failed "
                f"({type(error).__name__}: {error}); a pod left mid-step, nothing was stepped"
            ) from error
        return vote[1:], peaks

    def _reduce_gradients(self, parameters: list[torch.nn.Parameter]) -> BaseException | None:
        """SUM each gradient's local shard over the pods, in flat buckets."""
        if self._alone():  # the sum over one pod: the gradients as they are
            return self.manager.errored()
        grads = []
        for param in parameters:
            if not param.requires_grad:
                continue
            if param.grad is None:  # every pod must send the same buckets
                param.grad = torch.zeros_like(param)
            grads.append(_local(param.grad))
        buckets = gradient_buckets(grads, self.settings.gradient_bucket_mib << 20)
        error = self._allreduce([flat for _, flat in buckets], dist.ReduceOp.SUM)
        if error is not None:
            return error
        with torch.no_grad():
            for chunk, flat in buckets:
                offset = 0
                for tensor in chunk:
                    count = tensor.numel()
                    tensor.copy_(flat[offset : offset + count].view_as(tensor))
                    offset += count
        return None

    def abort(self, reason: BaseException) -> None:
        """Every rank of a pod that aborts the step: peers still waiting for this pod's vote
        get a failed one, and the step ends without a commit."""
        if self._in_quorum and not self._voted:
            self._voted = True
            vote = torch.zeros(1 + self._metric_count, dtype=torch.float64, device=self._device)
            vote[0] = 1
            self._allreduce([vote], dist.ReduceOp.SUM)
        self.close(f"{type(reason).__name__}: {reason}")

    def commit(self) -> bool:
        """Every rank: torchft's commit vote of this pod (no error in any cross-pod operation
        on any of its ranks). True: step now."""
        if not self._in_quorum:
            return False
        self._in_quorum = False
        try:
            return bool(self.manager.should_commit())
        except Exception:
            log.exception("torchft should_commit failed; the step is not applied")
            return False

    def close(self, reason: str) -> None:
        """End a step that will not be applied: torchft counts a failed commit, so the next
        quorum rebuilds the cross-pod process group."""
        if not self._in_quorum:
            return
        self.manager.report_error(ReplicaStepError(reason))
        self.commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


class _AdmittingClient:
    """torchft's manager client whose quorums pass ``check`` (it raises) before torchft acts on
    them: a heal from a peer, the process group's rebuild."""

    def __init__(self, client: Any, check: Callable[[list[str]], None]) -> None:
        self._client = client
        self._check = check

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._client._quorum(*args, **kwargs)
        self._check(list(result.replica_ids))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def gradient_buckets(
    grads: list[torch.Tensor], bucket_bytes: int
) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
    """``grads`` in flat buckets of one device and dtype each, a bucket closed once it holds
    ``bucket_bytes`` or more: (its tensors, their concatenated copy)."""
    buckets: list[tuple[list[torch.Tensor], torch.Tensor]] = []
    kinds: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        kinds.setdefault((grad.device, grad.dtype), []).append(grad)
    for tensors in kinds.values():
        chunk: list[torch.Tensor] = []
        size = 0
        for tensor in tensors:
            chunk.append(tensor)
            size += tensor.numel() * tensor.element_size()
            if size >= bucket_bytes:
                buckets.append((chunk, torch.cat([t.reshape(-1) for t in chunk])))
                chunk, size = [], 0
        if chunk:
            buckets.append((chunk, torch.cat([t.reshape(-1) for t in chunk])))
    return buckets


def _copy_into(target: dict[str, Any], received: dict[str, Any]) -> dict[str, Any]:
    """``target`` (this rank's state dicts) with every tensor overwritten in place by the
    tensor at the same path of ``received`` and every other leaf taken from ``received``."""
    leaves, spec = tree_flatten_with_path(target)
    incoming = {keystr(path): value for path, value in tree_flatten_with_path(received)[0]}
    if len(incoming) != len(leaves):
        raise ReplicaStateError(
            f"a peer pod's state has {len(incoming)} entries, this trainer's {len(leaves)}; "
            "every pod needs the same model and optimizer settings"
        )
    values = []
    with torch.no_grad():
        for path, mine in leaves:
            key = keystr(path)
            if key not in incoming:
                raise ReplicaStateError(f"a peer pod's state has no {key}")
            theirs = incoming[key]
            if isinstance(mine, torch.Tensor):
                local = _local(mine)
                if tuple(local.shape) != tuple(theirs.shape):
                    raise ReplicaStateError(
                        f"{key}: a peer pod's shard has shape {tuple(theirs.shape)}, this "
                        f"trainer's {tuple(local.shape)}"
                    )
                local.copy_(theirs)
                values.append(mine)
            else:
                values.append(theirs)
    return tree_unflatten(values, spec)
