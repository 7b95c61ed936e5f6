"""The generate and score phases of a step: RPC fan-outs over every healthy worker, and the
checks that their replies are whole before anything is trained on them.

Either phase raises ``StepFailedError`` when a worker fails or a reply is incomplete; the loop
then throws the attempt away and retries the step with the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from podrl.config.loop import SamplingConfig
from podrl.controller.batch import StepSamples, sample_id
from podrl.controller.clients import WorkerClients, fan_out
from podrl.controller.membership import MemberRegistry
from podrl.controller.step_errors import TRANSPORT_FAILURES, StepFailedError, describe_rpc_error
from podrl.tasks import PromptItem
from podrl.v1 import common_pb2, controller_pb2, generator_pb2, grader_pb2

T = TypeVar("T")


def split_round_robin(items: Sequence[T], parts: int) -> list[list[T]]:
    """Round-robin split into ``parts`` non-empty chunks (fewer when there are few items)."""
    chunks = [list(items[i::parts]) for i in range(parts)]
    return [chunk for chunk in chunks if chunk]


class WorkerPhases:
    """Generate and Score over the healthy workers the registry knows."""

    def __init__(
        self, clients: WorkerClients, pool: ThreadPoolExecutor, registry: MemberRegistry
    ) -> None:
        self.clients = clients
        self.pool = pool
        self.registry = registry

    def addresses(self, component: int) -> list[str]:
        return self.registry.healthy_addresses(component)

    def on_rpc_failure(self, address: str, err: grpc.RpcError) -> None:
        """A worker that cannot be reached is taken out until it heartbeats again."""
        if err.code() in TRANSPORT_FAILURES:
            self.registry.mark_unreachable(address)

    # -- generate ----------------------------------------------------------------------------
    def generate(
        self,
        step: int,
        data: StepSamples,
        sampling: SamplingConfig,
        seed: int | None,
        policy_version: int,
    ) -> None:
        """``sampling.n`` samples of every prompt into ``data.samples``; every one must come
        back, sampled by ``policy_version``."""
        generators = self.addresses(controller_pb2.COMPONENT_GENERATOR)
        if not generators:
            raise StepFailedError("generate", "no healthy generator is registered")
        params = common_pb2.SamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            stop=sampling.stop,
        )
        if seed is not None:
            params.seed = seed

        def call(address: str, chunk: list[PromptItem]) -> generator_pb2.GenerateResponse:
            request = generator_pb2.GenerateRequest(
                prompts=[
                    common_pb2.Prompt(
                        id=item.id,
                        text=item.prompt,
                        task=item.task,
                        reference=item.reference,
                        metadata=item.metadata,
                    )
                    for item in chunk
                ],
                sampling=params,
                request_id=f"step-{step}",
            )
            try:
                return self.clients.generator(address).Generate(request, timeout=self.clients.long)
            except grpc.RpcError as err:
                self.on_rpc_failure(address, err)
                raise StepFailedError(
                    "generate", f"generator {address}: {describe_rpc_error(err)}"
                ) from err

        chunks = split_round_robin(data.items, len(generators))
        replies = fan_out(
            self.pool,
            [lambda a=a, c=c: call(a, c) for a, c in zip(generators, chunks, strict=False)],
        )
        for reply in replies:
            for sample in reply.samples:
                data.samples.setdefault(sample.prompt_id, []).append(sample)
        for item in data.items:
            group = data.samples.get(item.id, [])
            if len(group) != sampling.n:
                raise StepFailedError(
                    "generate", f"prompt {item.id}: {len(group)} samples, expected {sampling.n}"
                )
            stale = [x.policy_version for x in group if x.policy_version != policy_version]
            if stale:
                raise StepFailedError(
                    "generate",
                    f"prompt {item.id}: sampled by policy version {stale[0]}, expected "
                    f"{policy_version}",
                )

    # -- score -------------------------------------------------------------------------------
    def score(self, data: StepSamples) -> None:
        """A score for every sample into ``data.scores`` (a failed score is still a score: its
        ``error`` says so, and ``podrl.controller.batch`` leaves it out of training)."""
        graders = self.addresses(controller_pb2.COMPONENT_GRADER)
        if not graders:
            raise StepFailedError("score", "no healthy grader is registered")
        items = [
            grader_pb2.ScoreItem(
                id=sample_id(item.id, sample.index),
                prompt=item.prompt,
                completion=sample.text,
                reference=item.reference,
                task=item.task,
                metadata=item.metadata,
            )
            for item, sample in data.all_samples()
        ]

        def call(address: str, chunk: list[grader_pb2.ScoreItem]) -> grader_pb2.ScoreResponse:
            try:
                return self.clients.grader(address).Score(
                    grader_pb2.ScoreRequest(items=chunk), timeout=self.clients.long
                )
            except grpc.RpcError as err:
                self.on_rpc_failure(address, err)
                raise StepFailedError(
                    "score", f"grader {address}: {describe_rpc_error(err)}"
                ) from err

        chunks = split_round_robin(items, len(graders))
        for reply in fan_out(
            self.pool, [lambda a=a, c=c: call(a, c) for a, c in zip(graders, chunks, strict=False)]
        ):
            for score in reply.scores:
                data.scores[score.id] = score
        missing = [item.id for item in items if item.id not in data.scores]
        if missing:
            raise StepFailedError("score", f"{len(missing)} samples unscored, e.g. {missing[0]}")
