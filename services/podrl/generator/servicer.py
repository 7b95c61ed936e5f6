"""gRPC Generator service: protobuf in and out, status codes; the work is done by the engine's
parts (``engine_build.EngineParts``: ``Generation``, ``WeightApplier``, ``SleepMode``), which
the RPCs call directly.

Status codes:
- Generate: INVALID_ARGUMENT for bad sampling values (temperature NaN or infinite, n > 1 with
  greedy sampling, n above vLLM's cap) or prompts (a text too long for ``max_model_len`` is
  refused by its length before it is tokenised); UNAVAILABLE while the engine loads;
  FAILED_PRECONDITION while asleep, while the weight state is needs_full (the message says
  "needs a full manifest"; also for a call running when an in-flight apply left that state) or
  when the served weights produced a logprob that is not finite (no sample is returned);
  DEADLINE_EXCEEDED when the caller's deadline passes (the engine aborts the requests).
- ApplyWeights: PERMISSION_DENIED for a manifest without the MAC of the pod's weights key;
  INVALID_ARGUMENT for a manifest that does not describe this model (names, shapes, dtypes,
  tiling, shard counts over the caps); FAILED_PRECONDITION for a stale or out-of-order version
  (a rollback not to an older version included), a version-only manifest for unknown storage
  or while needs_full, an untrusted publisher, storage that cannot be opened or is unsafe, or
  weights that are not finite: nothing was written, the weight state is unchanged.
  A write that failed part-way answers FAILED_PRECONDITION "needs a full manifest" (the state
  is needs_full; the controller then sends the full manifest), one that failed before vLLM's
  parameters were touched ABORTED (the previous version keeps serving; retry).
  DEADLINE_EXCEEDED when the apply passed its deadline (see ``WeightApplier``). INVALID_ARGUMENT
  for ``in_flight`` with ``rollback``.
- Sleep/WakeUp: FAILED_PRECONDITION where vLLM has no sleep mode (CPU) or it is switched off.
"""

from __future__ import annotations

import logging
import math

import grpc

import podrl
from podrl.config import RunConfig
from podrl.generator.engine_build import EngineParts, VllmEngine
from podrl.generator.errors import GeneratorUnavailableError, InvalidRequestError
from podrl.generator.generation import NonFiniteOutputError, SamplingRequest
from podrl.generator.sleep_mode import SleepUnsupportedError
from podrl.generator.weight_applier import UNSUPPORTED, LockTimeoutError, WeightApplyError
from podrl.generator.worker_extension import ErrorKind, WeightsNotServableError, WeightState
from podrl.v1 import common_pb2, generator_pb2, generator_pb2_grpc
from podrl.weights.errors import ManifestError

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


APPLY_FAILURE_STATUS = {
    # The previous version keeps serving: the caller retries.
    ErrorKind.FAILED_KEEPS_SERVING: grpc.StatusCode.ABORTED,
    # The controller answers this with the full manifest.
    ErrorKind.FAILED_NEEDS_FULL: grpc.StatusCode.FAILED_PRECONDITION,
    # A refusal is answered by its manifest error's kind (``ManifestError.status_code``); one
    # worker's refusal beside another's failure keeps serving or needs a full manifest.
}
"""ApplyWeights' status for an apply the workers failed, by the kind they reported."""


def sampling_from_proto(params: common_pb2.SamplingParams) -> SamplingRequest:
    """Resolve proto3 zero values: n 0 → 1, top_p 0 → 1.0 (off), top_k 0 → off; a request must
    set max_tokens (≥ 1). temperature 0 is greedy sampling."""
    if params.max_tokens < 1:
        raise InvalidRequestError("sampling.max_tokens must be ≥ 1")
    if not math.isfinite(params.temperature) or params.temperature < 0:
        raise InvalidRequestError(
            f"sampling.temperature must be a finite number ≥ 0 (0 = greedy), not "
            f"{params.temperature}"
        )
    if params.temperature == 0 and params.n > 1:
        raise InvalidRequestError(
            f"sampling.n must be 1 with greedy sampling (temperature 0): its {params.n} samples "
            "would all be the same; set a temperature > 0 for n > 1"
        )
    if not 0.0 <= params.top_p <= 1.0:
        raise InvalidRequestError("sampling.top_p must be in [0, 1] (0 = no nucleus filter)")
    if params.top_k < -1:
        raise InvalidRequestError("sampling.top_k must be ≥ -1 (0 or -1 = no top-k filter)")
    if any(not s for s in params.stop):
        raise InvalidRequestError("sampling.stop must not contain empty strings")
    if params.HasField("seed"):
        check_seed("sampling.seed", params.seed, params.n or 1)
    return SamplingRequest(
        n=params.n or 1,
        temperature=params.temperature,
        top_p=params.top_p or 1.0,
        top_k=params.top_k if params.top_k > 0 else -1,
        max_tokens=params.max_tokens,
        stop=tuple(params.stop),
        seed=params.seed if params.HasField("seed") else None,
        include_stop=params.include_stop_str_in_output,
    )


#: torch's random generators take seeds up to this one.
MAX_SEED = 2**64 - 1


def check_seed(field: str, seed: int, n: int) -> None:
    """vLLM seeds sample i of a prompt with ``seed + i``; past MAX_SEED torch's generator
    raises inside the engine core (the in-process engine failed, and the call was answered
    UNKNOWN), so such a seed is refused before the engine sees it."""
    if seed + n - 1 > MAX_SEED:
        raise InvalidRequestError(
            f"{field} ({seed}) + sampling.n - 1 must be at most 2**64 - 1 (vLLM seeds sample i "
            "with seed + i); choose a smaller seed"
        )


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(self, config: RunConfig, engine: VllmEngine) -> None:
        self._config = config
        self._engine = engine
        self._parts: EngineParts | None = None
        """The engine's parts, once it has started (:meth:`mark_ready`); the RPCs call them."""

    def mark_ready(self) -> None:
        """The engine has started: from now on the RPCs call its parts."""
        if self._engine.parts is None:
            raise RuntimeError("mark_ready before the engine started")
        self._parts = self._engine.parts

    def _started(self, context: grpc.ServicerContext) -> EngineParts:
        parts = self._parts
        if parts is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the vLLM engine is still loading")
        return parts

    def Generate(
        self, request: generator_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generator_pb2.GenerateResponse:
        generation = self._started(context).generation
        if not request.prompts:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompts: at least one prompt")
        try:
            sampling = sampling_from_proto(request.sampling)
            cap = self._config.generator.max_samples_per_request
            if len(request.prompts) * sampling.n > cap:
                raise InvalidRequestError(
                    f"prompts x sampling.n: {len(request.prompts)} x {sampling.n} completions "
                    f"exceed generator.max_samples_per_request ({cap}); split the request"
                )
            token_ids = []
            seeds: list[int | None] = []
            longest = generation.max_prompt_chars
            for i, prompt in enumerate(request.prompts):
                if prompt.HasField("seed"):
                    check_seed(f"prompts[{i}].seed", prompt.seed, sampling.n)
                seeds.append(prompt.seed if prompt.HasField("seed") else None)
                if not prompt.token_ids and longest is not None and len(prompt.text) > longest:
                    # Before the tokenizer sees it: one 100 MB prompt took 21 GB and minutes.
                    raise InvalidRequestError(
                        f"prompts[{i}].text: {len(prompt.text)} characters cannot fit "
                        f"generator.max_model_len ({self._config.generator.max_model_len}) "
                        f"tokens (at most {longest} characters can); shorten the prompt"
                    )
                ids = list(prompt.token_ids) or generation.tokenize(prompt.text)
                if not ids:
                    raise InvalidRequestError(f"prompts[{i}]: neither token_ids nor text given")
                token_ids.append(ids)
            result = generation.generate(
                token_ids,
                sampling,
                request.request_id,
                timeout=context.time_remaining(),
                on_cancel=lambda cancel: context.add_callback(cancel),
                seeds=seeds,
            )
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except (GeneratorUnavailableError, WeightsNotServableError) as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except NonFiniteOutputError as err:
            log.error("%s", err)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except (TimeoutError, LockTimeoutError) as err:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"generate: {err or 'deadline'}")
        response = generator_pb2.GenerateResponse(policy_version=result.policy_version)
        for prompt, out in zip(request.prompts, result.prompts, strict=True):
            response.prompt_tokens += len(out.prompt_token_ids)
            for c in out.completions:
                response.completion_tokens += len(c.token_ids)
                # add() builds the sample in place; append() would build it, then copy it.
                response.samples.add(
                    prompt_id=prompt.id,
                    index=c.index,
                    prompt_token_ids=out.prompt_token_ids,
                    token_ids=c.token_ids,
                    text=c.text,
                    logprobs=c.logprobs,
                    finish_reason=_FINISH_REASONS.get(
                        c.finish_reason, common_pb2.FINISH_REASON_UNSPECIFIED
                    ),
                    policy_version=result.policy_version,
                    last_policy_version=out.last_policy_version,
                )
        return response

    def ApplyWeights(
        self, request: generator_pb2.ApplyWeightsRequest, context: grpc.ServicerContext
    ) -> generator_pb2.ApplyWeightsResponse:
        applier = self._started(context).applier
        if not request.HasField("manifest"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "manifest: required")
        try:
            result = applier.apply(
                request.manifest,
                context.time_remaining(),
                rollback=request.rollback,
                in_flight=request.in_flight,
            )
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except ManifestError as err:
            log.warning("manifest version %d rejected: %s", request.manifest.version, err)
            context.abort(err.status_code, str(err))
        except WeightApplyError as err:
            log.error("%s", err)
            context.abort(APPLY_FAILURE_STATUS[err.kind], str(err))
        except GeneratorUnavailableError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except (TimeoutError, LockTimeoutError) as err:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"apply weights: {err or 'deadline'}")
        log.info(
            "applied policy version %d in %.3fs (%s, plan cached: %s, in flight: %s)",
            result.policy_version,
            result.seconds,
            result.mode,
            result.plan_cached,
            result.in_flight,
        )
        return generator_pb2.ApplyWeightsResponse(
            policy_version=result.policy_version,
            apply_seconds=result.seconds,
            plan_cached=result.plan_cached,
            in_flight=result.in_flight,
        )

    def Sleep(
        self, request: generator_pb2.SleepRequest, context: grpc.ServicerContext
    ) -> generator_pb2.SleepResponse:
        sleep_mode = self._started(context).sleep_mode
        try:
            sleep_mode.sleep(request.level or 1, context.time_remaining())
        except SleepUnsupportedError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        except InvalidRequestError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"level: {err}")
        return generator_pb2.SleepResponse()

    def WakeUp(
        self, request: generator_pb2.WakeUpRequest, context: grpc.ServicerContext
    ) -> generator_pb2.WakeUpResponse:
        sleep_mode = self._started(context).sleep_mode
        try:
            sleep_mode.wake_up(context.time_remaining())
        except SleepUnsupportedError as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
        return generator_pb2.WakeUpResponse()

    def Tokenize(
        self, request: generator_pb2.TokenizeRequest, context: grpc.ServicerContext
    ) -> generator_pb2.TokenizeResponse:
        generation = self._started(context).generation
        cap, longest = self._config.generator.max_samples_per_request, generation.max_prompt_chars
        if len(request.texts) > cap:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"texts: {len(request.texts)} texts exceed generator.max_samples_per_request "
                f"({cap}); split the request",
            )
        for i, text in enumerate(request.texts):
            if longest is not None and len(text) > longest:
                # As for a prompt: refused by its length before the tokenizer sees it.
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"texts[{i}]: {len(text)} characters cannot fit generator.max_model_len "
                    f"tokens (at most {longest} characters can)",
                )
        return generator_pb2.TokenizeResponse(
            tokens=[
                generator_pb2.TokenIds(ids=generation.tokenize(text, special=False))
                for text in request.texts
            ]
        )

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> generator_pb2.GeneratorInfo:
        facts = self._engine.facts
        parts = self._parts
        weights = WeightState() if parts is None else parts.applier.state
        details = {"state": "loading" if parts is None else "serving"}
        if weights.reason:
            details["weight_state_reason"] = weights.reason
        if facts is not None:
            details |= {
                "weight_apply_mode": facts.apply_mode,
                "engine_start_seconds": f"{facts.start_seconds:.1f}",
                "unfinished_requests": str(self._engine.unfinished_requests),
                **facts.extra,
            }
        gen = self._config.generator
        return generator_pb2.GeneratorInfo(
            info=common_pb2.ServiceInfo(
                service="podrl.v1.Generator",
                version=podrl.__version__,
                worker_id=self._config.worker_id,
                details=details,
            ),
            model=facts.model if facts else "",
            policy_version=weights.version,
            tensor_parallel_size=gen.tensor_parallel_size,
            device=facts.device if facts else self._config.device,
            dtype=gen.dtype,
            sleeping=parts is not None and parts.sleep_mode.sleeping,
            weight_state=weights.phase.value,
            in_flight_apply=UNSUPPORTED if parts is None else parts.applier.in_flight_apply,
        )
