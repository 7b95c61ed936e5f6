"""Runs inside every vLLM worker process: writes new policy weights into the worker's model.

vLLM mixes this class into its worker (``worker_extension_cls``); the engine reaches its
methods with ``collective_rpc``. Only plain values cross that boundary: an apply is one
``ApplyRequest`` (the manifest as serialised protobuf bytes), its answer one ``WorkerReply``
(``podrl.generator.worker_messages``), each as a dict of plain values. The tensors are
read here, in the worker, straight from the trainer's shared memory.

Each worker owns its :class:`~podrl.generator.weight_state.WorkerWeights`: the one record of
which version its parameters hold. Every reply carries that state, and the engine only mirrors
it. An apply commits its version after the copy *and* vLLM's load finished; one that fails
before vLLM's parameters are touched leaves the previous version serving, one that fails after
leaves ``needs_full``.

Three ways to write weights, all vLLM's own code:

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

import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from podrl.common import faults
from podrl.generator import vllm_compat

log = logging.getLogger(__name__)

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
    faults.hit("generator.reload", version=version)
    for index, item in enumerate(tensors):
        if index == len(tensors) // 2:
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

    # ---- what the service asks the workers -------------------------------------------------

    def podrl_describe(
        self, mode: str = "auto", generator_pid: int | None = None
    ) -> dict[str, Any]:
        """The apply mode ``mode`` resolves to, the parameters repacked after loading, the
        state.

        Called once per worker when the engine starts: from then on nothing of the engine
        outlives the generator ``generator_pid`` (``engine_processes.die_with_generator``)."""
        if generator_pid is not None:
            from podrl.generator.engine_processes import die_with_generator

            die_with_generator(generator_pid)
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
        from podrl.generator.weight_state import Admission, WeightPhase
        from podrl.generator.worker_messages import ApplyRequest, ErrorKind, WorkerReply
        from podrl.v1 import weights_pb2
        from podrl.weights.errors import ManifestError

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
                faults.hit("generator.apply_weights", version=manifest.version)
                if resolved == "in_place":
                    params = dict(self.model_runner.get_model().named_parameters())
                    receiver.start(manifest, destinations=params)
                    guard.touching_served_weights()
                    # Returns when the copies are done (the copy plan waits for its streams).
                    receiver.update()
                    copied = receiver.finish()
                    faults.hit("generator.mid_copy", version=manifest.version)
                elif resolved == "repack":
                    model = self.model_runner.get_model()
                    targets = self._podrl_repack_targets(model)
                    receiver.start(manifest, destinations=targets)
                    guard.touching_served_weights()
                    receiver.update()
                    copied = receiver.finish()
                    faults.hit("generator.mid_copy", version=manifest.version)
                    _repack(model, targets)
                else:
                    copied = receiver.apply(manifest)
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
            from podrl.generator.weight_state import WorkerWeights

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
                layout = vllm_layout(description, *vllm_compat.tensor_parallel_rank_and_size())
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
