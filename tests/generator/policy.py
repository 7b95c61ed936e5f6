"""The tests' side of a weight sync: a `transformers` copy of the policy, its publisher, and the
generator calls the tests make (real gRPC against the generator service process).

Tolerance: generator and `transformers` both run the tiny model in float32; per-token logprobs
agree to a few 1e-6 (measured); the tests allow 1e-4. Two versions of the tests' perturbations
differ by far more (> 1e-2 on every sample measured), so a sample matches exactly one.
"""

from __future__ import annotations

import threading
import time

import grpc
import torch
from transformers import AutoModelForCausalLM

from podrl.v1 import common_pb2, generator_pb2, weights_pb2
from podrl.weights import ManifestAssembler, WeightPublisher
from tests.generator.conftest import WORKER_ID, GeneratorProcess
from tests.harness.weights import publish_single_process

LOGPROB_TOLERANCE = 1e-4
OTHER_VERSION_MIN_DIFF = 1e-3
PROMPTS = ["user: add 2 and 3\nassistant: ", "The quick brown fox"]

Snapshot = dict[str, torch.Tensor]


class Policy:
    """The test's copy of the policy the generator should be serving, and its publisher."""

    def __init__(self, generator: GeneratorProcess) -> None:
        torch.manual_seed(1234)
        self.model = AutoModelForCausalLM.from_pretrained(generator.model_path, dtype=torch.float32)
        self.model.eval()
        self.version = 0
        self.publisher = WeightPublisher(self.model)
        self.assembler = ManifestAssembler(WORKER_ID, generator.key)
        self.lock = threading.Lock()
        self.snapshots: dict[int, Snapshot] = {0: self.snapshot()}
        """The weights of every version published, to check samples against."""

    def perturb(self, scale: float = 0.5) -> None:
        with torch.no_grad():
            for param in self.model.parameters():
                param.add_(scale * torch.randn_like(param))

    def snapshot(self) -> Snapshot:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def load(self, version: int) -> None:
        """Put the weights of ``version`` back into the model (same storage, in place)."""
        self.model.load_state_dict(self.snapshots[version])

    def manifest(self, version: int, force_full: bool = False) -> weights_pb2.WeightManifest:
        self.snapshots[version] = self.snapshot()
        return publish_single_process(
            self.publisher, self.assembler, version, force_full=force_full, ack_timeout=5
        )

    @torch.no_grad()
    def logprobs(self, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt_ids + completion_ids])
        logits = self.model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0]

    def diff_to(self, version: int, sample: common_pb2.Sample) -> float:
        """Max abs logprob difference of ``sample`` against the weights of ``version``."""
        current = self.snapshot()
        self.load(version)
        try:
            return max_logprob_diff(self, sample)
        finally:
            self.model.load_state_dict(current)

    def versions_matching(self, sample: common_pb2.Sample, versions: list[int]) -> list[int]:
        """The versions among ``versions`` whose logprobs ``sample`` matches. Raises if a
        version is neither clearly matched nor clearly different (a tolerance problem)."""
        matching = []
        for version in versions:
            diff = self.diff_to(version, sample)
            if diff < LOGPROB_TOLERANCE:
                matching.append(version)
            elif diff < OTHER_VERSION_MIN_DIFF:
                raise AssertionError(f"sample vs version {version}: ambiguous diff {diff:.2e}")
        return matching


def generate(
    generator: GeneratorProcess, prompts: list[str] = PROMPTS, **sampling: object
) -> generator_pb2.GenerateResponse:
    params = {"max_tokens": 16, "temperature": 1.0, **sampling}
    return generator.stub.Generate(
        generator_pb2.GenerateRequest(
            prompts=[common_pb2.Prompt(id=f"p{i}", text=t) for i, t in enumerate(prompts)],
            sampling=common_pb2.SamplingParams(**params),
            request_id="test",
        ),
        timeout=120,
    )


def apply(
    generator: GeneratorProcess,
    manifest: weights_pb2.WeightManifest,
    timeout: float = 120,
    rollback: bool = False,
) -> generator_pb2.ApplyWeightsResponse:
    return generator.stub.ApplyWeights(
        generator_pb2.ApplyWeightsRequest(manifest=manifest, rollback=rollback), timeout=timeout
    )


def info(generator: GeneratorProcess) -> generator_pb2.GeneratorInfo:
    return generator.stub.Info(common_pb2.InfoRequest(), timeout=10)


def max_logprob_diff(policy: Policy, sample: common_pb2.Sample) -> float:
    ref = policy.logprobs(list(sample.prompt_token_ids), list(sample.token_ids))
    return (ref - torch.tensor(list(sample.logprobs))).abs().max().item()


class BackgroundGenerate:
    """Generate calls in a loop on other threads; every reply and every refusal is kept."""

    def __init__(self, generator: GeneratorProcess, threads: int = 2) -> None:
        self.generator = generator
        self.replies: list[generator_pb2.GenerateResponse] = []
        self.refusals: list[tuple[grpc.StatusCode, str]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self) -> BackgroundGenerate:
        for thread in self._threads:
            thread.start()
        self.wait_for_another_reply()  # at least one sample from before what the test does
        return self

    def wait_for_another_reply(self, timeout: float = 120) -> None:
        """Block until one more Generate call was answered (a hang guard bounds the wait)."""
        count = len(self.replies)
        deadline = time.monotonic() + timeout
        while len(self.replies) == count and not self.errors:
            assert time.monotonic() < deadline, "no Generate reply within the hang guard"
            time.sleep(0.05)
        assert not self.errors, self.errors

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=180)

    def _run(self, index: int) -> None:
        seed = 1000 * index
        try:
            while not self._stop.is_set():
                seed += 1
                try:
                    self.replies.append(generate(self.generator, n=2, max_tokens=12, seed=seed))
                except grpc.RpcError as err:
                    if err.code() != grpc.StatusCode.FAILED_PRECONDITION:
                        raise
                    self.refusals.append((err.code(), err.details()))
                    self._stop.wait(0.2)
        except BaseException as err:
            self.errors.append(err)
