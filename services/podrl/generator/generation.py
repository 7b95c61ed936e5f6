"""Generation: sampling, stop tokens, prompt caps, and podrl's view of vLLM's outputs.

:class:`Generation` submits a Generate call's prompts to vLLM's engine on its loop thread and
holds the read side of the weight lock (``WeightApplier.reading``) from submission to the last
token, so that a swap waits for it. At most ``max_concurrent_requests`` calls run at once; vLLM
batches them. A stop string that one token stands for becomes a stop token (vLLM then skips
its detokenizer; the text is decoded once here), and a prompt text too long to fit
``max_model_len`` tokens is refused by its length before it is tokenised
(:attr:`Generation.max_prompt_chars`). No sample with a logprob that is NaN or infinite is ever
returned (:class:`NonFiniteOutputError`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from podrl.config.generator import GeneratorConfig
from podrl.generator.engine_runtime import EngineLoop, deadline_after, seconds_left
from podrl.generator.errors import InvalidRequestError
from podrl.generator.vllm_compat import request_errors
from podrl.generator.weight_applier import GenerateSpan, LockTimeoutError, WeightApplier

log = logging.getLogger(__name__)


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
    include_stop: bool = False
    """Keep the stop string that ended a sample at the end of its text."""


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


class Generation:
    """Generate calls on one started vLLM engine. Thread-safe."""

    def __init__(
        self,
        config: GeneratorConfig,
        engine: Any,
        loop: EngineLoop,
        applier: WeightApplier,
    ) -> None:
        self._engine = engine
        self._loop = loop
        self._applier = applier
        self._admission = threading.BoundedSemaphore(config.max_concurrent_requests)
        self._request_ids = itertools.count()
        tokenizer = engine.get_tokenizer()
        self._lone_tokens: dict[str, int] = {}
        """ASCII characters that only one token contains, that token being the character."""
        try:
            self._lone_tokens = lone_character_tokens(tokenizer)
        except Exception:  # a tokenizer without this surface: vLLM checks every stop string
            log.warning("the tokenizer cannot be scanned for stop tokens", exc_info=True)
        longest = longest_token_bytes(tokenizer)
        self.max_prompt_chars = None if longest is None else config.max_model_len * longest
        """Prompt texts longer than this cannot fit ``max_model_len`` tokens: refused before
        tokenising (None: the tokenizer did not say how long its tokens are)."""

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """``text``'s ids; ``special=False`` adds no special tokens (a text inside an episode)."""
        tokenizer = self._engine.get_tokenizer()
        if special:
            return list(tokenizer.encode(text))
        return list(tokenizer.encode(text, add_special_tokens=False))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingRequest,
        request_id: str,
        timeout: float | None,
        on_cancel: Callable[[Callable[[], None]], None] | None = None,
        seeds: Sequence[int | None] | None = None,
    ) -> GenerateResult:
        """Sample ``sampling.n`` completions per prompt, all under one policy version (or, when
        an in-flight apply lands meanwhile, the versions each prompt's ``last_policy_version``
        says from the call's ``policy_version`` on). ``seeds``: one per prompt, in place of
        ``sampling.seed`` where not None."""
        deadline = deadline_after(timeout)
        stop_token_ids = stop_tokens_for(sampling.stop, self._lone_tokens)
        shared = self._sampling_params(sampling, stop_token_ids)
        params = [
            shared
            if seed is None
            else self._sampling_params(replace(sampling, seed=seed), stop_token_ids)
            for seed in (seeds or [None] * len(prompts))
        ]
        if not self._admission.acquire(timeout=seconds_left(deadline)):
            raise LockTimeoutError("too many concurrent Generate calls; deadline passed waiting")
        try:
            with self._applier.reading(seconds_left(deadline)):
                self._applier.require_awake()
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
            prompt_completions(out, last, decode, sampling.include_stop)
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

    def _sampling_params(self, sampling: SamplingRequest, stop_token_ids: list[int] | None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if stop_token_ids is not None:
            stop: dict[str, Any] = {"stop_token_ids": stop_token_ids, "detokenize": False}
        else:
            stop = {
                "stop": list(sampling.stop) or None,
                "include_stop_str_in_output": sampling.include_stop,
            }
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
        self, prompts: Sequence[Sequence[int]], params: Sequence[Any], request_id: str
    ) -> tuple[list[Any], GenerateSpan]:
        """The final outputs, and the versions served while they were sampled. On the loop
        thread, where in-flight applies change the mirror (between two engine steps), so the
        versions read here bound those that sampled each token."""
        from vllm.inputs import TokensPrompt

        applier = self._applier
        applier.state.require_servable()  # needs_full: no version to sample from
        span = GenerateSpan(applier.state.version, [applier.state.version] * len(prompts))

        async def one(index: int, token_ids: Sequence[int]) -> Any:
            final = None
            rid = f"{request_id or 'gen'}-{next(self._request_ids)}-{index}"
            async for output in self._engine.generate(
                TokensPrompt(prompt_token_ids=list(token_ids)), params[index], rid
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


def stop_tokens_for(stop: Sequence[str], lone_tokens: dict[str, int]) -> list[int] | None:
    """Token ids that end every sample exactly where ``stop`` would, or None.

    vLLM checks stop strings on its incremental detokenizer's text, and with logprobs on
    it also detokenizes every sampled token for the logprob entries (the demo's Generate
    took about a tenth less without, docs/performance.md). When each stop string is one
    ASCII character that exactly one vocabulary token contains, and that token is the
    character (``lone_character_tokens``), the string appears in the text exactly when
    that token is sampled (an ASCII byte is never part of another character's bytes): a
    stop token does the same job without the detokenizer, and the text is decoded once
    per sample. Else (and with no stop strings) vLLM detokenizes as usual."""
    if not stop or any(text not in lone_tokens for text in stop):
        return None
    return sorted({lone_tokens[text] for text in stop})


def lone_character_tokens(tokenizer: Any) -> dict[str, int]:
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


def longest_token_bytes(tokenizer: Any) -> int | None:
    """UTF-8 bytes of the tokenizer's longest vocabulary entry: no token stands for more bytes
    of text (byte-level and sentencepiece spellings are at least as long as what they stand
    for), so a text of more than ``max_model_len`` x this many bytes has too many tokens."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary: the message size is the bound
        log.warning("the tokenizer lists no vocabulary: prompts are not capped before tokenising")
        return None
    return max((len(str(token).encode()) for token in vocab), default=None)


def prompt_completions(
    output: Any,
    last_version: int,
    decode: Callable[..., str] | None = None,
    include_stop: bool = False,
) -> PromptCompletions:
    """podrl's view of one prompt's vLLM output, finished under ``last_version``; ``decode``
    (the tokenizer's) when vLLM did not detokenize: the text then ends before a stop token, as
    vLLM's ends before a stop string, unless ``include_stop`` (then it ends with it)."""
    completions = []
    for c in sorted(output.outputs, key=lambda c: c.index):
        token_ids = list(c.token_ids)
        logprobs = [step[token].logprob for step, token in zip(c.logprobs, token_ids, strict=True)]
        text = c.text
        if decode is not None:
            stopped = (
                not include_stop
                and isinstance(c.stop_reason, int)
                and token_ids[-1:] == [c.stop_reason]
            )
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
