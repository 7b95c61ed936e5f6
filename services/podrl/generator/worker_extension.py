"""Runs inside every vLLM worker process: the weight state the worker owns, what it says to the
engine, and how it writes new policy weights into the worker's model.

vLLM mixes :class:`PodrlWorkerExtension` into its worker (``worker_extension_cls``); the engine
reaches its methods with ``collective_rpc``. The tensors are read here, in the worker, straight
from the trainer's shared memory.

**The weight state** (:class:`WeightState`, :class:`WorkerWeights`). Which version a generator
serves is one small state machine, owned by the workers. Every worker holds one
:class:`WorkerWeights`; it is the only code that changes the worker's :class:`WeightState`, and
the only place where a manifest's version is checked against what is served
(:meth:`WeightState.admit`; which storage a version-only manifest may name is the worker's
``WeightReceiver``'s to check: its copy plan reads that storage). The engine keeps no counter
of its own: it mirrors the state the workers send back with every reply (:func:`combine` for
several tensor-parallel workers; ``podrl.generator.weight_applier`` is the mirror's one writer).

::

    idle(v) --apply w--> applying(v -> w) --copied and loaded into vLLM--> idle(w)
                                  |
                                  +-- failed before vLLM's parameters were touched --> idle(v)
                                  +-- failed after, or the engine stopped waiting ----> needs_full
    needs_full --a full manifest applied--> idle(w)

* ``idle(v)``: version ``v`` serves. A manifest is admitted when its version is newer (a
  version-only one then goes on to the receiver, which applies it only from the storage its
  copy plan reads); the version and storage (``fingerprint``) served already is a no-op.
* ``applying``: a write is in progress; Generate is held back (the engine's write lock).
* ``needs_full``: the served parameters are not known to be any one version (a copy or a vLLM
  reload failed half-way, an apply overran its deadline, a level-2 sleep dropped the weights).
  Generate is refused and so is every version-only manifest; a full manifest of ``version`` or
  newer clears the state. ``version`` stays the last version completely applied.

A version is committed only after the copy *and* the load into vLLM finished, so a state never
names weights that are not fully in place: one that fails before vLLM's parameters are touched
leaves the previous version serving, one that fails after leaves ``needs_full``.

**What the engine and the workers say** (:class:`ApplyRequest`, :class:`WorkerReply`,
:class:`ErrorKind`). ``collective_rpc`` hands its arguments over as they are when vLLM's engine
core runs in the generator's process, and through msgpack (a dataclass arrives as a map, an
enum as its value) when it runs in its own, so each message crosses as a dict of plain values,
the same on both: the engine sends one :class:`ApplyRequest` (``podrl_apply_manifest``, the
manifest as serialised protobuf bytes), every worker answers one :class:`WorkerReply` carrying
its weight state. A failed apply's :class:`ErrorKind` is set where the worker caught the
exception; the engine raises it again as a typed error and the servicer maps it to a status
code through one table (``servicer.APPLY_FAILURE_STATUS``).

**Writing the weights.** Three ways, all vLLM's own code:

* ``in_place``: the receiver's copy plan writes straight into vLLM's (fused, tensor-parallel)
  parameters. Right where parameters are plain tensors that keep their loaded layout, e.g.
  unquantised weights on GPUs.
* ``repack``: as ``in_place``, but a linear weight that vLLM's post-load step removed (the
  CPU backend packs it for its GEMM kernel and leaves a ``[0]`` parameter) is written into a
  buffer of its loaded shape; then vLLM's ``process_weights_after_loading`` runs again for
  every unquantised linear and embedding layer, which packs the new values. No weight loader
  and no layer restore: a version-only apply of the tiny model took 8-15 ms where ``reload``
  took 26-33 (about 0.8 ms of it per layer is vLLM's packing; docs/generator.md).
* ``reload``: the receiver fills full tensors in HF naming, then vLLM's layer-wise reload
  (``Worker.reload_weights`` with checkpoint-format weights) restores each layer to its loaded
  layout, runs the model's weight loaders, runs ``process_weights_after_loading`` again (the CPU
  backend repacks linear weights there; its parameters then show shape ``[0]`` and an in-place
  copy would change nothing) and copies the result into the kernel tensors the engine uses.

``auto`` picks ``in_place`` when every parameter still has the shape and dtype recorded when
the model was loaded (vLLM records it for reloading), ``repack`` when the only changed ones
are removed weights of unquantised linear layers, else ``reload``.

Fault points (``podrl.common.faults``, keyword ``version``): ``generator.apply_weights`` (an
apply was admitted, nothing written yet), ``generator.after_copy`` (reload mode: the
receiver's own buffers are filled, vLLM untouched), ``generator.reload`` (vLLM's reload has
begun, before its first tensor), ``generator.mid_copy`` (reload mode: vLLM has loaded half the
tensors; in_place and repack modes: the copy into vLLM's parameters and buffers has run, and
in repack mode nothing is packed yet).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch

from podrl.common import faults
from podrl.generator import vllm_compat
from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind

log = logging.getLogger(__name__)


# ---- the weight state ------------------------------------------------------------------------

NEEDS_FULL_HINT = "the generator needs a full manifest"
"""Every refusal caused by ``needs_full`` says this (the controller answers with a full one)."""


class WeightPhase(enum.StrEnum):
    IDLE = "idle"
    APPLYING = "applying"
    NEEDS_FULL = "needs_full"


class Admission(enum.Enum):
    APPLY = "apply"
    UNCHANGED = "unchanged"
    """The manifest names the version and storage already served: nothing to copy."""


class WeightsNotServableError(RuntimeError):
    """Generate was refused: the served parameters are not one known version."""


@dataclass(frozen=True)
class WeightState:
    phase: WeightPhase = WeightPhase.IDLE
    version: int = 0
    """idle: the version served (0: the weights loaded from the model folder); applying: the
    version being replaced; needs_full: the last version that was completely applied."""
    fingerprint: str | None = None
    """Storage of the last full manifest applied while idle; None when none was or when the
    served weights no longer come from it (needs_full)."""
    target: int | None = None
    """applying: the version being written."""
    reason: str = ""
    """needs_full: what left the weights unknown."""

    # ---- checks ------------------------------------------------------------------------------

    def admit(self, manifest: weights_pb2.WeightManifest, rollback: bool = False) -> Admission:
        """Whether ``manifest`` may be applied now; raises ``ManifestError`` (a refusal:
        nothing is written) with a FAILED_PRECONDITION kind otherwise.

        ``rollback`` accepts an older version (the trainer went back to a checkpoint), as a
        full manifest only, and only a version older than the last one applied. Which storage a
        version-only manifest names is not checked here: the receiver refuses one whose storage
        its copy plan does not read (``WeightReceiver.validate``)."""
        version = manifest.version
        if manifest.version_only and (rollback or self.phase is WeightPhase.NEEDS_FULL):
            why = "a rollback" if rollback else self.reason
            raise ManifestError(
                ManifestErrorKind.FINGERPRINT,
                f"version-only manifest of version {version} refused: {why}; "
                f"{NEEDS_FULL_HINT}: publish with force_full",
            )
        if rollback:
            # Back to a checkpoint means an older version: never a relabelled or rewritten
            # served one (the weights of "version v" must stay those of version v).
            if version >= self.version:
                raise ManifestError(
                    ManifestErrorKind.STALE_VERSION,
                    f"a rollback must go to an older version than {self.version} (the last "
                    f"version applied), not to {version}; send newer versions without rollback",
                )
            return Admission.APPLY
        if self.phase is WeightPhase.NEEDS_FULL:
            # The served weights are unknown, so the last good version may be written again.
            if version < self.version:
                raise ManifestError(
                    ManifestErrorKind.STALE_VERSION,
                    f"version {version} is older than the last version applied "
                    f"({self.version}); {NEEDS_FULL_HINT} of version {self.version} or newer "
                    "(or a rollback)",
                )
            return Admission.APPLY
        if (
            version == self.version
            and self.fingerprint is not None
            and manifest.model_fingerprint == self.fingerprint
        ):
            return Admission.UNCHANGED  # a caller that lost the reply retries
        if version <= self.version:
            raise ManifestError(
                ManifestErrorKind.STALE_VERSION,
                f"version {version} is not newer than the version being served "
                f"({self.version}); publish a newer version",
            )
        return Admission.APPLY

    def require_servable(self) -> None:
        """Raise ``WeightsNotServableError`` unless one known version is in place."""
        if self.phase is WeightPhase.NEEDS_FULL:
            raise WeightsNotServableError(
                f"{NEEDS_FULL_HINT} before it can generate: {self.reason}"
            )
        if self.phase is WeightPhase.APPLYING:
            raise WeightsNotServableError(f"version {self.target} is being applied")

    # ---- transitions -------------------------------------------------------------------------

    def begin(self, version: int) -> WeightState:
        """idle | needs_full -> applying(version)."""
        if self.phase is WeightPhase.APPLYING:
            raise RuntimeError(f"an apply of version {self.target} is already in progress")
        return replace(self, phase=WeightPhase.APPLYING, target=version)

    def commit(self, fingerprint: str | None) -> WeightState:
        """applying(v -> w) -> idle(w) from storage ``fingerprint``."""
        if self.phase is not WeightPhase.APPLYING or self.target is None:
            raise RuntimeError(f"commit without an apply in progress (state {self.phase})")
        return WeightState(WeightPhase.IDLE, self.target, fingerprint)

    def needs_full(self, reason: str) -> WeightState:
        """Any state -> needs_full; ``version`` stays the last version completely applied."""
        return WeightState(WeightPhase.NEEDS_FULL, self.version, None, None, reason)

    # ---- crossing collective_rpc (plain values only) -----------------------------------------

    def to_wire(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "target": self.target,
            "reason": self.reason,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WeightState:
        return cls(
            phase=WeightPhase(wire["phase"]),
            version=int(wire["version"]),
            fingerprint=wire["fingerprint"],
            target=wire["target"],
            reason=wire["reason"],
        )

    def describe(self) -> str:
        if self.phase is WeightPhase.APPLYING:
            return f"applying {self.version} -> {self.target}"
        if self.phase is WeightPhase.NEEDS_FULL:
            return f"needs_full (last applied {self.version}: {self.reason})"
        return f"idle (serving {self.version})"


def combine(states: Sequence[WeightState]) -> WeightState:
    """One state for an engine of several workers: theirs when they agree, else needs_full."""
    if not states:
        raise ValueError("no worker states")
    first = states[0]
    if all(state == first for state in states):
        return first
    return WeightState(
        WeightPhase.NEEDS_FULL,
        min(state.version for state in states),
        reason="the workers disagree: " + "; ".join(state.describe() for state in states),
    )


class WriteGuard:
    """Handed to the code inside :meth:`WorkerWeights.applying`: it calls
    :meth:`touching_served_weights` right before it writes into the parameters vLLM serves."""

    def __init__(self) -> None:
        self.served_weights_touched = False

    def touching_served_weights(self) -> None:
        self.served_weights_touched = True


class WorkerWeights:
    """One worker's weight state and the only code that changes it."""

    def __init__(self) -> None:
        self.state = WeightState()

    @contextmanager
    def applying(self, version: int, fingerprint: str | None) -> Iterator[WriteGuard]:
        """applying(v -> version) for the duration of the block; idle(version) from storage
        ``fingerprint`` when it ends normally. When it raises: back to the state before if
        the served parameters were not touched yet (a refused manifest, a failed copy into
        buffers of the worker's own), else needs_full."""
        before = self.state
        self.state = before.begin(version)
        guard = WriteGuard()
        try:
            yield guard
        except BaseException as exc:
            if guard.served_weights_touched:
                self.state = before.needs_full(
                    f"applying version {version} failed part-way ({type(exc).__name__}: {exc})"
                )
            else:
                self.state = before
            raise
        self.state = self.state.commit(fingerprint)

    def weights_dropped(self, reason: str) -> None:
        """The served parameters are gone or unknown (level-2 sleep): needs_full."""
        self.state = self.state.needs_full(reason)


# ---- what the engine and the workers say -----------------------------------------------------


class ErrorKind(enum.StrEnum):
    """Why a worker's apply did not commit."""

    REFUSED = "refused"
    """The manifest was refused (``ManifestError``): nothing was written, the state is as
    before."""
    FAILED_KEEPS_SERVING = "failed_keeps_serving"
    """Failed before vLLM's parameters were touched: the version served before keeps serving
    (retry)."""
    FAILED_NEEDS_FULL = "failed_needs_full"
    """Failed, and the weight state is needs_full (vLLM's parameters were touched, or were of no
    known version before): only a full manifest brings one back."""


@dataclass(frozen=True)
class ApplyRequest:
    """One ``podrl_apply_manifest`` call: apply ``manifest`` (a serialised
    ``podrl.v1.WeightManifest``) with ``mode`` (``generator.weight_apply_mode``)."""

    manifest: bytes
    mode: str
    trusted_publisher_id: str
    """Only manifests whose ``publisher_id`` is this are applied (the pod's trainer)."""
    copy_streams: int
    """``generator.weight_copy_streams``: the streams the worker's copy plan forks over."""
    rollback: bool = False
    """Accept an older version (full manifests only) and reopen every handle."""
    segment_owner_uid: int | None = None
    """The user whose shared-memory segments may be opened (the owner of the pod's weights
    key: the trainer's)."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "manifest": self.manifest,
            "mode": self.mode,
            "trusted_publisher_id": self.trusted_publisher_id,
            "copy_streams": self.copy_streams,
            "rollback": self.rollback,
            "segment_owner_uid": self.segment_owner_uid,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ApplyRequest:
        return cls(
            manifest=bytes(wire["manifest"]),
            mode=str(wire["mode"]),
            trusted_publisher_id=str(wire["trusted_publisher_id"]),
            copy_streams=int(wire["copy_streams"]),
            rollback=bool(wire["rollback"]),
            segment_owner_uid=wire["segment_owner_uid"],
        )


@dataclass(frozen=True)
class WorkerReply:
    """One worker's answer to an :class:`ApplyRequest`: its weight state after the call, and
    either how the apply ran or why it did not commit."""

    state: WeightState
    mode: str = ""
    """The apply mode that ran (``unchanged``: the version and storage already served)."""
    plan_cached: bool = False
    seconds: float = 0.0
    error_kind: ErrorKind | None = None
    error: str = ""
    """What went wrong (a refusal: the manifest error's message, without its kind)."""
    refusal: ManifestErrorKind | None = None
    """``REFUSED``: the manifest error's kind."""
    refused_name: str | None = None
    """``REFUSED``: the parameter the refusal names, if any."""

    @classmethod
    def refused(cls, err: ManifestError, state: WeightState) -> WorkerReply:
        return cls(
            state,
            error_kind=ErrorKind.REFUSED,
            error=err.message,
            refusal=err.kind,
            refused_name=err.name,
        )

    def manifest_error(self) -> ManifestError:
        """The refusal, raised again on the engine's side of ``collective_rpc``."""
        if self.error_kind is not ErrorKind.REFUSED or self.refusal is None:
            raise ValueError(f"not a refusal: {self}")
        return ManifestError(self.refusal, self.error, name=self.refused_name)

    def to_wire(self) -> dict[str, Any]:
        return {
            "state": self.state.to_wire(),
            "mode": self.mode,
            "plan_cached": self.plan_cached,
            "seconds": self.seconds,
            "error_kind": None if self.error_kind is None else self.error_kind.value,
            "error": self.error,
            "refusal": None if self.refusal is None else self.refusal.value,
            "refused_name": self.refused_name,
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WorkerReply:
        return cls(
            state=WeightState.from_wire(wire["state"]),
            mode=str(wire["mode"]),
            plan_cached=bool(wire["plan_cached"]),
            seconds=float(wire["seconds"]),
            error_kind=None if wire["error_kind"] is None else ErrorKind(wire["error_kind"]),
            error=str(wire["error"]),
            refusal=None if wire["refusal"] is None else ManifestErrorKind(wire["refusal"]),
            refused_name=wire["refused_name"],
        )


# ---- writing the weights --------------------------------------------------------------------

APPLY_MODES = ("auto", "in_place", "repack", "reload")


def _changed_after_loading(model: torch.nn.Module) -> Iterator[tuple[str, Any, Any, Any]]:
    """``(full name, module, live tensor or None, recorded tensor)`` of each parameter whose
    live shape/dtype differs from the layout recorded at load time (vLLM's reload metadata):
    post-load processing repacked it."""
    for module_name, module in model.named_modules():
        for name, recorded in vllm_compat.recorded_layout(module).items():
            live = getattr(module, name, None)
            if (
                not isinstance(live, torch.Tensor)
                or tuple(live.shape) != tuple(recorded.shape)
                or live.dtype != recorded.dtype
            ):
                full = f"{module_name}.{name}" if module_name else name
                yield full, module, live, recorded


def _tensors_changed_after_loading(model: torch.nn.Module) -> list[str]:
    """Names of parameters that post-load processing repacked."""
    return [full for full, _, _, _ in _changed_after_loading(model)]


def _repack_plan(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """For ``repack`` mode: parameter name → the tensor a copy writes (the live parameter, or,
    where vLLM's post-load step replaced a linear weight by an empty one, a buffer of its
    loaded shape); None when the model has repacked tensors this mode does not handle (then
    ``reload``). Only unquantised linear layers whose weight alone was removed qualify."""
    unquantized_linear, _ = vllm_compat.unquantized_methods()
    targets = dict(model.named_parameters())
    for full, module, live, recorded in _changed_after_loading(model):
        removed_weight = (
            full.rsplit(".", 1)[-1] == "weight"
            and isinstance(getattr(module, "quant_method", None), unquantized_linear)
            and isinstance(live, torch.Tensor)
            and live.numel() == 0
        )
        if not removed_weight:
            return None
        targets[full] = torch.empty(tuple(recorded.shape), dtype=recorded.dtype)
    return targets


def _repack(model: torch.nn.Module, targets: dict[str, torch.Tensor]) -> None:
    """vLLM's own post-load step (``quant_method.process_weights_after_loading``) for every
    unquantised linear and embedding layer, on the values just copied: the CPU backend packs
    its GEMM operands there (a linear layer's weight is then removed again; an embedding keeps
    its weight, and its packed copy for the logits is rebuilt)."""
    unquantized = vllm_compat.unquantized_methods()
    for module_name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if not isinstance(method, unquantized):
            continue
        weight = f"{module_name}.weight" if module_name else "weight"
        if module.weight.numel() == 0:
            module.weight = torch.nn.Parameter(targets[weight], requires_grad=False)
        method.process_weights_after_loading(module)


def _with_faults(
    tensors: list[tuple[str, torch.Tensor]], version: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors vLLM's loader consumes, with the fault points inside the load."""
    if faults.ARMED:
        faults.hit("generator.reload", version=version)
    for index, item in enumerate(tensors):
        if faults.ARMED and index == len(tensors) // 2:
            faults.hit("generator.mid_copy", version=version)
        yield item


class PodrlWorkerExtension:
    """Mixed into vLLM's worker class; every method is prefixed ``podrl_`` to avoid clashes."""

    # Set lazily (vLLM constructs the worker; a mixin has no __init__ of its own).
    _podrl_receiver: Any = None
    _podrl_resolved_mode: str | None = None
    _podrl_weights: Any = None
    _podrl_repack: dict[str, torch.Tensor] | None = None
    _podrl_repack_planned = False
    _podrl_tensor_parallel: tuple[int, int] | None = None
    """This worker's tensor-parallel rank and the group's size, read once by
    :meth:`podrl_describe` at engine start, so that no apply calls into vLLM's internals."""

    # ---- what the service asks the workers -------------------------------------------------

    def podrl_describe(
        self, mode: str = "auto", generator_pid: int | None = None
    ) -> dict[str, Any]:
        """The apply mode ``mode`` resolves to, the parameters repacked after loading, the
        state.

        Called once per worker when the engine starts: from then on nothing of the engine
        outlives the generator ``generator_pid`` (``engine_processes.die_with_generator``), and
        the worker knows its tensor-parallel rank (its receiver, built on the first apply,
        slices by it)."""
        if generator_pid is not None:
            from podrl.generator.engine_processes import die_with_generator

            die_with_generator(generator_pid)
        self._podrl_tensor_parallel = vllm_compat.tensor_parallel_rank_and_size()
        model = self.model_runner.get_model()
        return {
            "apply_mode": self._podrl_resolve_mode(mode),
            "repacked": _tensors_changed_after_loading(model),
            "state": self._podrl_state().state.to_wire(),
        }

    def podrl_weight_state(self) -> dict[str, Any]:
        """This worker's weight state (the engine re-reads it after an apply it stopped
        waiting for)."""
        return self._podrl_state().state.to_wire()

    def podrl_apply_manifest(self, request: dict[str, Any]) -> dict[str, Any]:
        """Apply one ``ApplyRequest`` (its wire form): a serialised ``podrl.v1.WeightManifest``,
        full or version-only.

        The weight state admits it (version order, fingerprint, needs_full), then the worker's
        ``podrl.weights.Receiver`` starts the update (validates its content, opens its handles
        once per fingerprint) and updates (runs its cached copy plan): in ``in_place`` mode
        straight into vLLM's parameters, in ``reload`` mode into full HF-named buffers that
        vLLM's layer-wise reload then loads. ``rollback`` accepts an older version (full
        manifests only) and reopens every handle. The engine checked the manifest's MAC before
        sending it.

        Returns a ``WorkerReply`` (its wire form): how the apply ran, or its ``ErrorKind``
        (a refused manifest: nothing written; a failed apply: the previous version keeps
        serving, or needs_full, as the weight state says).
        """
        apply = ApplyRequest.from_wire(request)
        manifest = weights_pb2.WeightManifest.FromString(apply.manifest)
        weights = self._podrl_state()
        start = time.perf_counter()
        try:
            if weights.state.admit(manifest, apply.rollback) is Admission.UNCHANGED:
                return WorkerReply(weights.state, mode="unchanged", plan_cached=True).to_wire()
            resolved = self._podrl_resolve_mode(apply.mode)
            if apply.rollback:  # the trainer restarted: its storage is new, reopen everything
                self.podrl_release_weights()
            receiver = self._podrl_get_receiver(
                resolved, apply.trusted_publisher_id, apply.copy_streams
            )
            if apply.segment_owner_uid is not None:
                receiver.segment_owner_uid = apply.segment_owner_uid
            # A refusal from the receiver (its start) comes before it writes anything: the
            # block then leaves the state as it was.
            with weights.applying(manifest.version, manifest.model_fingerprint) as guard:
                if faults.ARMED:
                    faults.hit("generator.apply_weights", version=manifest.version)
                if resolved == "in_place":
                    params = dict(self.model_runner.get_model().named_parameters())
                    receiver.start(manifest, destinations=params)
                    guard.touching_served_weights()
                    # Returns when the copies are done (the copy plan waits for its streams).
                    receiver.update()
                    copied = receiver.finish()
                    if faults.ARMED:
                        faults.hit("generator.mid_copy", version=manifest.version)
                elif resolved == "repack":
                    model = self.model_runner.get_model()
                    targets = self._podrl_repack_targets(model)
                    receiver.start(manifest, destinations=targets)
                    guard.touching_served_weights()
                    receiver.update()
                    copied = receiver.finish()
                    if faults.ARMED:
                        faults.hit("generator.mid_copy", version=manifest.version)
                    _repack(model, targets)
                else:
                    copied = receiver.apply(manifest)
                    if faults.ARMED:
                        faults.hit("generator.after_copy", version=manifest.version)
                    guard.touching_served_weights()
                    self._podrl_reload(_with_faults(copied.tensors, manifest.version))
        except ManifestError as err:
            return WorkerReply.refused(err, weights.state).to_wire()
        except Exception as err:
            log.exception("applying version %d failed", manifest.version)
            if weights.state.phase is WeightPhase.NEEDS_FULL:
                kind = ErrorKind.FAILED_NEEDS_FULL
            else:
                kind = ErrorKind.FAILED_KEEPS_SERVING
            return WorkerReply(
                weights.state, error_kind=kind, error=f"{type(err).__name__}: {err}"
            ).to_wire()
        return WorkerReply(
            weights.state,
            mode=resolved,
            plan_cached=copied.plan_cached,
            seconds=time.perf_counter() - start,
        ).to_wire()

    def podrl_drop_weights(self, reason: str) -> dict[str, Any]:
        """The served parameters are gone (level-2 sleep): close every handle; only a full
        manifest is accepted from now on."""
        self.podrl_release_weights()
        weights = self._podrl_state()
        weights.weights_dropped(reason)
        return weights.state.to_wire()

    def podrl_release_weights(self) -> None:
        """Close every handle the receiver holds (engine shutdown, trainer restarted); the
        weight state stays (the parameters keep what they hold)."""
        if self._podrl_receiver is not None:
            self._podrl_receiver.close()
            self._podrl_receiver = None

    # ---- internals ---------------------------------------------------------------------------

    def _podrl_state(self) -> Any:
        if self._podrl_weights is None:
            self._podrl_weights = WorkerWeights()
        return self._podrl_weights

    def _podrl_get_receiver(self, mode: str, trusted_publisher_id: str, copy_streams: int) -> Any:
        """One receiver per worker, built on first use: it holds the opened handles and the
        cached copy plan between versions."""
        if self._podrl_receiver is None:
            from podrl.weights import ModelDescription, WeightReceiver, vllm_layout

            description = ModelDescription.from_pretrained(self.vllm_config.model_config.model)
            dtype = self.vllm_config.model_config.dtype
            layout = None
            if mode in ("in_place", "repack"):
                if self._podrl_tensor_parallel is None:
                    raise RuntimeError("podrl_describe runs at engine start, before any apply")
                layout = vllm_layout(description, *self._podrl_tensor_parallel)
            self._podrl_receiver = WeightReceiver(
                description,
                layout=layout,
                dtype=dtype,
                device="cpu" if mode == "reload" else self.device,
                trusted_publisher_id=trusted_publisher_id,
                copy_streams=copy_streams,
            )
        return self._podrl_receiver

    def _podrl_resolve_mode(self, mode: str) -> str:
        if mode not in APPLY_MODES:
            raise ValueError(f"weight_apply_mode {mode!r}: use one of {APPLY_MODES}")
        if mode != "auto":
            return mode
        if self._podrl_resolved_mode is None:
            model = self.model_runner.get_model()
            if not _tensors_changed_after_loading(model):
                self._podrl_resolved_mode = "in_place"
            elif self._podrl_repack_targets(model) is not None:
                self._podrl_resolved_mode = "repack"
            else:
                self._podrl_resolved_mode = "reload"
        return self._podrl_resolved_mode

    def _podrl_repack_targets(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """``_repack_plan`` of this worker's model, made once (its buffers are the copy plan's
        destinations from then on)."""
        if not self._podrl_repack_planned:
            self._podrl_repack = _repack_plan(model)
            self._podrl_repack_planned = True
        return self._podrl_repack

    def _podrl_reload(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's layer-wise reload of checkpoint-format (HF-named) tensors.

        A reload that raises part-way leaves layers on the meta device with their weight
        loaders wrapped: the engine could neither run them nor reload them again. vLLM's own
        finalisation then puts every layer back on its kernel tensors (layers not reached keep
        their old values), so the model runs and a later full reload starts clean; the weight
        state says needs_full meanwhile.
        """
        try:
            vllm_compat.reload_checkpoint_weights(self, tensors)
        except BaseException:
            try:
                vllm_compat.finalize_failed_reload(self)
            except Exception:
                log.exception("finalising the failed reload failed too")
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
