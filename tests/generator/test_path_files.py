"""The generator's files a Generate and a version-only ApplyWeights run through, as
docs/architecture.md's "How many files a step and a sync touch" lists them: the servicer calls
the engine's parts directly (no facade), the sleep level is checked in the weight applier (no
sleep mode code), and the worker's state and messages are one file with the worker side.

vLLM is faked (an engine that answers one sample, workers that answer one reply), so this
shows the engine side; the worker's own apply runs in ``worker_extension.py``, already counted
(test_weight_faults.py and test_generator_service.py run it for real). Every function the two
RPCs call is recorded, on the gRPC thread and on the engine's loop thread."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc

from podrl.config import RunConfig
from podrl.config.generator import GeneratorConfig
from podrl.generator.engine_build import EngineParts
from podrl.generator.engine_runtime import EngineLoop
from podrl.generator.generation import Generation
from podrl.generator.servicer import GeneratorServicer
from podrl.generator.sleep_mode import SleepMode
from podrl.generator.worker_extension import WorkerReply
from podrl.v1 import common_pb2, generator_pb2, weights_pb2
from tests.generator.appliers import SERVED, signed_applier
from tests.harness.file_hook import file_hook

GENERATOR = Path(__file__).resolve().parents[2] / "services" / "podrl" / "generator"

# docs/architecture.md, the generator's lines of both lists.
GENERATE_AND_APPLY = {
    "servicer.py",
    "generation.py",
    "engine_runtime.py",
    "weight_applier.py",
    "worker_extension.py",
}
APPLY = {"servicer.py", "weight_applier.py", "engine_runtime.py", "worker_extension.py"}


class Tokenizer:
    all_special_ids = ()

    def __len__(self) -> int:
        return 2

    def decode(self, ids: list[int], **_: Any) -> str:
        return "".join("ab"[i] for i in ids)

    def encode(self, text: str) -> list[int]:
        return ["ab".index(c) for c in text]

    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "b": 1}


class FakeVllm:
    """vLLM's engine as the generator's parts use it: one sample per request, one worker."""

    def __init__(self) -> None:
        self.reply = WorkerReply(SERVED.begin(4).commit("storage-a"), mode="in_place")

    def get_tokenizer(self) -> Tokenizer:
        return Tokenizer()

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        sample = SimpleNamespace(
            index=0,
            token_ids=[1],
            logprobs=[{1: SimpleNamespace(logprob=-0.5)}],
            text="b",
            finish_reason="length",
            stop_reason=None,
        )
        yield SimpleNamespace(
            outputs=[sample], prompt_token_ids=prompt["prompt_token_ids"], finished=True
        )

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        assert method == "podrl_apply_manifest"
        return [self.reply.to_wire()]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return True


class Context:
    """What the servicer asks of a gRPC context."""

    def time_remaining(self) -> float:
        return 30.0

    def add_callback(self, callback: Any) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


class Recorder:
    """The generator files whose functions run inside :meth:`recording`, on the calling thread
    and on the engine's loop thread."""

    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self.files: set[str] = set()

    async def _on_loop_thread(self, hook: Any) -> None:
        sys.setprofile(hook)

    @contextmanager
    def recording(self) -> Iterator[set[str]]:
        self.files = set()
        hook = file_hook(GENERATOR, self.files)
        self._loop.run(self._on_loop_thread(hook), 10)
        sys.setprofile(hook)
        try:
            yield self.files
        finally:
            sys.setprofile(None)
            self._loop.run(self._on_loop_thread(None), 10)


def test_a_generate_and_an_apply_run_the_files_the_reading_order_lists(tmp_path: Path) -> None:
    config = GeneratorConfig()
    vllm = FakeVllm()
    loop = EngineLoop()
    loop.start()
    try:
        applier, key = signed_applier(tmp_path, config, vllm, loop)
        parts = EngineParts(
            generation=Generation(config, vllm, loop, applier),
            applier=applier,
            sleep_mode=SleepMode(config, "cpu", vllm, loop, applier),
        )
        servicer = GeneratorServicer(RunConfig(), SimpleNamespace(parts=parts))  # type: ignore[arg-type]
        servicer.mark_ready()
        generate = generator_pb2.GenerateRequest(
            prompts=[common_pb2.Prompt(id="p", text="ab")],
            sampling=common_pb2.SamplingParams(n=1, temperature=1.0, max_tokens=1),
        )
        manifest = weights_pb2.WeightManifest(
            version=4, model_fingerprint="storage-a", version_only=True
        )
        key.sign(manifest)

        apply = generator_pb2.ApplyWeightsRequest(manifest=manifest)
        # Once unrecorded: the first calls import vLLM's and podrl's lazy modules.
        servicer.Generate(generate, Context())  # type: ignore[arg-type]
        servicer.ApplyWeights(apply, Context())  # type: ignore[arg-type]
        recorder = Recorder(loop)
        with recorder.recording() as step_files:
            reply = servicer.Generate(generate, Context())  # type: ignore[arg-type]
            applied = servicer.ApplyWeights(apply, Context())  # type: ignore[arg-type]
        with recorder.recording() as sync_files:
            servicer.ApplyWeights(apply, Context())  # type: ignore[arg-type]
    finally:
        loop.stop()
    assert (reply.samples[0].token_ids, applied.policy_version) == ([1], 4)
    assert step_files == GENERATE_AND_APPLY
    assert sync_files == APPLY
