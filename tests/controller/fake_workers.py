"""Small stand-ins for one pod's trainer and generator, served over real gRPC on loopback.

They keep exactly the contracts the controller relies on, and let a test inject the failures the
controller must survive (a Train reply lost while the trainer computes, a trainer that applies a
batch and then errors, a trainer that keeps no batch ids). The real services run in
test_loop_e2e.py; these let the loop's decisions be tested in seconds.

Trainer contract kept here (proto/podrl/v1/trainer.proto): one Train at a time; a Train whose
batch_id equals the last applied one is answered with the stored reply and trains nothing; a
request for another policy version than the one held is INVALID_ARGUMENT; Info (lock-free, as
the real one) reports version, last_batch_id and last_train; LoadCheckpoint forgets the last
batch id.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from podrl.controller.pods.table import Pod
from podrl.controller.records.checkpoint_files import STATE_FILE
from podrl.v1 import (
    common_pb2,
    generator_pb2,
    generator_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weights_pb2,
)


@dataclass
class TrainFault:
    """What happens to one Train call that gets past the dedupe."""

    delay_before_apply: float = 0.0
    """Compute time: Info still shows the old version meanwhile."""
    delay_after_apply: float = 0.0
    """The reply is late (past the client's deadline: lost) though the batch was applied."""
    abort_before_apply: grpc.StatusCode | None = None
    abort_after_apply: grpc.StatusCode | None = None


@dataclass
class FakeTrainer(trainer_pb2_grpc.TrainerServicer):
    checkpoint_dir: Path
    keeps_batch_ids: bool = True
    version: int = 0
    step: int = 0
    last_batch_id: str = ""
    last_train: trainer_pb2.TrainResponse | None = None
    faults: list[TrainFault] = field(default_factory=list)
    """One entry per Train call that reaches the trainer's work, in order."""
    train_seconds: float = 0.0
    """Compute time of every Train that reaches the trainer's work (async tests: the producer
    generates meanwhile)."""
    applied: list[trainer_pb2.TrainRequest] = field(default_factory=list)
    received: list[str] = field(default_factory=list)
    """batch_id of every Train call, in arrival order."""
    acknowledged: list[int] = field(default_factory=list)
    on_abort: Callable[[], None] | None = None
    """Runs before an injected abort_before_apply (e.g. another batch lands meanwhile)."""
    pod_id: str = "pod-0"
    group: FakeReplicaGroup | None = None
    """Pods training one policy together (a stand-in for torchft across pods)."""
    digest: str = "initial"
    """Stands for the parameters: a hash chain over every batch applied (step_digest)."""
    dead: bool = False
    generator: FakeGenerator | None = None
    """The pod's generator: each Train notes whether it was asleep (``trained_while_asleep``)."""
    trained_while_asleep: list[bool] = field(default_factory=list)
    published_while_generating: list[bool] = field(default_factory=list)
    """Each PublishWeights: whether the pod's generator was running a Generate meanwhile."""
    save_faults: list[grpc.StatusCode | None] = field(default_factory=list)
    """One entry per SaveCheckpoint call, in order: the code it fails with (None: it saves)."""
    train_metrics: dict[str, float] = field(default_factory=dict)
    """More TrainMetrics fields every Train reports (e.g. a huge mismatch_kl)."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _published_full: bool = False

    def ParametersDigest(
        self, request: trainer_pb2.ParametersDigestRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ParametersDigestResponse:
        return trainer_pb2.ParametersDigestResponse(
            policy_version=self.version, step=self.step, sha256=self.digest
        )

    def Train(
        self, request: trainer_pb2.TrainRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainResponse:
        self.received.append(request.batch_id)
        if self.generator is not None:
            self.trained_while_asleep.append(self.generator.asleep)
        with self._lock:
            if self.keeps_batch_ids and request.batch_id and request.batch_id == self.last_batch_id:
                assert self.last_train is not None
                return self.last_train
            fault = self.faults.pop(0) if self.faults else TrainFault()
            time.sleep(fault.delay_before_apply + self.train_seconds)
            if fault.abort_before_apply is not None:
                if self.on_abort is not None:
                    self.on_abort()
                context.abort(fault.abort_before_apply, "injected failure before the update")
            if self.group is not None:
                self.group.step(self, request, context)  # heals, checks the quorum, or aborts
            if request.policy_version != self.version:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"TrainRequest.policy_version: the trainer holds version {self.version}",
                )
            if self.group is not None:
                self.group.exchange(self, context)  # every pod computed, or all abort
            self.digest = step_digest(
                self.digest, self.group.batch(self) if self.group else request
            )
            self.version += 1
            self.step += 1
            reply = trainer_pb2.TrainResponse(
                policy_version=self.version,
                step=self.step,
                metrics=trainer_pb2.TrainMetrics(
                    loss=0.5 + len(self.applied),
                    grad_norm=1.0,
                    tokens=sum(len(s.completion_ids) for s in request.sequences),
                    **self.train_metrics,
                ),
            )
            self.applied.append(request)
            if self.keeps_batch_ids:
                self.last_batch_id, self.last_train = request.batch_id, reply
            time.sleep(fault.delay_after_apply)
            if fault.abort_after_apply is not None:
                context.abort(fault.abort_after_apply, "injected failure after the update")
            return reply

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.TrainerInfo:
        info = trainer_pb2.TrainerInfo(
            policy_version=self.version, step=self.step, last_batch_id=self.last_batch_id
        )
        if self.last_train is not None:
            info.last_train.CopyFrom(self.last_train)
        return info

    def PublishWeights(
        self, request: trainer_pb2.PublishWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.PublishWeightsResponse:
        if self.generator is not None:
            self.published_while_generating.append(self.generator.generating)
        version_only = self._published_full and not request.force_full
        self._published_full = True
        return trainer_pb2.PublishWeightsResponse(
            manifest=weights_pb2.WeightManifest(
                version=self.version,
                model_fingerprint="fake",
                version_only=version_only,
                publisher_id=self.pod_id,
            )
        )

    def AcknowledgeWeights(
        self, request: trainer_pb2.AcknowledgeWeightsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.AcknowledgeWeightsResponse:
        self.acknowledged.append(request.version)
        return trainer_pb2.AcknowledgeWeightsResponse()

    def SaveCheckpoint(
        self, request: trainer_pb2.SaveCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.SaveCheckpointResponse:
        if self.save_faults and (code := self.save_faults.pop(0)) is not None:
            context.abort(code, "[Errno 28] No space left on device (injected)")
        path = Path(request.path or self.checkpoint_dir / f"step-{self.step:08d}")
        path.mkdir(parents=True, exist_ok=True)
        (path / ".metadata").write_bytes(b"")
        state = {
            "step": self.step,
            "policy_version": self.version,
            "controller_state": base64.b64encode(request.controller_state).decode(),
        }
        (path / STATE_FILE).write_text(json.dumps(state))
        return trainer_pb2.SaveCheckpointResponse(
            path=str(path), step=self.step, policy_version=self.version
        )

    def LoadCheckpoint(
        self, request: trainer_pb2.LoadCheckpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.LoadCheckpointResponse:
        state_file = Path(request.path) / STATE_FILE
        if not state_file.is_file():
            context.abort(grpc.StatusCode.NOT_FOUND, f"{request.path} is no checkpoint")
        state = json.loads(state_file.read_text())
        with self._lock:
            self.step, self.version = state["step"], state["policy_version"]
            self.last_batch_id, self.last_train = "", None
            self._published_full = False
        return trainer_pb2.LoadCheckpointResponse(
            step=self.step,
            policy_version=self.version,
            controller_state=base64.b64decode(state["controller_state"]),
        )


def step_digest(before: str, batch: trainer_pb2.TrainRequest) -> str:
    """The fake parameters after applying ``batch``: they depend on the whole batch (every
    sequence and advantage, in any order), as the sum of the pods' gradients does."""
    items = sorted(f"{s.sample_id}:{s.advantage:.6f}" for s in batch.sequences)
    return hashlib.sha256("|".join([before, *items]).encode()).hexdigest()


@dataclass
class _Quorum:
    size: int
    members: list[FakeTrainer] = field(default_factory=list)
    requests: dict[int, trainer_pb2.TrainRequest] = field(default_factory=dict)
    closed: bool = False
    exchanged: set[int] = field(default_factory=set)


class FakeReplicaGroup:
    """The cross-pod contract of the real trainers (trainer/replication.py), in-process: a
    step's Train calls meet in a quorum of ``TrainRequest.pods`` trainers (ABORTED if it does
    not fill within ``quorum_timeout``); a trainer behind the most advanced member heals from it
    (version and parameters) before its version check; the shares must add up to the batch's
    totals; then every member waits for all to have computed (the gradient exchange): if one
    died meanwhile, all abort with nothing changed; otherwise each applies the WHOLE batch (the
    union of the shares)."""

    def __init__(self, quorum_timeout: float = 2.0) -> None:
        self.quorum_timeout = quorum_timeout
        self._cond = threading.Condition()
        self._open: _Quorum | None = None
        self._of: dict[int, _Quorum] = {}
        self.before_exchange: list[Callable[[], None]] = []
        """Run once each, in order, by the first member to reach an exchange (e.g. kill a pod
        mid-step)."""
        self.quorums: list[list[str]] = []
        """The batch ids of every quorum that filled, in order."""
        self.cancelled: list[str] = []
        """The batch ids of Train calls whose caller cancelled them while the quorum waited."""

    def step(self, trainer: FakeTrainer, request: trainer_pb2.TrainRequest, context: Any) -> None:
        with self._cond:
            quorum = self._open
            if quorum is None or quorum.closed or quorum.size != request.pods:
                quorum = self._open = _Quorum(max(request.pods, 1))
            quorum.members.append(trainer)
            quorum.requests[id(trainer)] = request
            self._of[id(trainer)] = quorum
            if len(quorum.members) == quorum.size:
                quorum.closed = True
                self.quorums.append(sorted(r.batch_id for r in quorum.requests.values()))
                self._cond.notify_all()
            # Re-checked every 50 ms: a caller that cancels ends the wait (as the real trainer's
            # quorum loop does, trainer/replication.py), with nothing stepped.
            deadline = time.monotonic() + self.quorum_timeout
            while not quorum.closed and context.is_active() and time.monotonic() < deadline:
                self._cond.wait(0.05)
            if not quorum.closed:
                quorum.members.remove(trainer)
                del quorum.requests[id(trainer)]
                if not context.is_active():
                    self.cancelled.append(request.batch_id)
                    context.abort(grpc.StatusCode.CANCELLED, "the caller cancelled this Train")
                context.abort(grpc.StatusCode.ABORTED, "the quorum of the step's pods never filled")
        lead = max(quorum.members, key=lambda t: t.version)
        if trainer.version < lead.version:  # heal from the most advanced peer
            trainer.version, trainer.step, trainer.digest = lead.version, lead.step, lead.digest
        shares = quorum.requests.values()
        if sum(len(r.sequences) for r in shares) != request.global_sequences:
            context.abort(grpc.StatusCode.ABORTED, "the shares do not add up to the batch")

    def exchange(self, trainer: FakeTrainer, context: Any) -> None:
        quorum = self._of[id(trainer)]
        with self._cond:
            hooks, self.before_exchange = self.before_exchange, []
        for hook in hooks:
            hook()
        with self._cond:
            quorum.exchanged.add(id(trainer))
            self._cond.notify_all()
            everyone = self._cond.wait_for(
                lambda: (
                    any(m.dead for m in quorum.members)
                    or len(quorum.exchanged) == len(quorum.members)
                ),
                self.quorum_timeout,
            )
            if trainer.dead or not everyone or any(m.dead for m in quorum.members):
                context.abort(grpc.StatusCode.ABORTED, "a peer failed in the gradient exchange")

    def batch(self, trainer: FakeTrainer) -> trainer_pb2.TrainRequest:
        """The union of the quorum's shares: what every member's update is made of."""
        quorum = self._of[id(trainer)]
        union = trainer_pb2.TrainRequest()
        for request in quorum.requests.values():
            union.sequences.extend(request.sequences)
        return union


def reference_then_wrong(prompt: common_pb2.Prompt, index: int) -> str:
    """Even samples answer right, odd ones wrong: every group has reward variance."""
    return prompt.reference if index % 2 == 0 else "wrong"


@dataclass
class FakeGenerator(generator_pb2_grpc.GeneratorServicer):
    complete: Callable[[common_pb2.Prompt, int], str] = reference_then_wrong
    version: int = 0
    weight_state: str = "idle"
    generated: list[str] = field(default_factory=list)
    """Prompt ids of every Generate call, in order."""
    on_generate: Callable[[], None] | None = None
    """Runs at the start of each Generate call (e.g. the pod is drained or killed meanwhile)."""
    on_apply: Callable[[], None] | None = None
    """Runs at the start of each ApplyWeights call."""
    applied: list[weights_pb2.WeightManifest] = field(default_factory=list)
    """Every manifest ApplyWeights got, in order."""
    version_of: Callable[[str, int], int] | None = None
    """(prompt id, version held) → the version its samples report (a generator that missed
    syncs, for the stale-group tests); None = the version held."""
    generate_seconds: float = 0.0
    """Time each Generate call takes (while it counts as running)."""
    overlaps: int = 0
    """ApplyWeights calls that arrived while a Generate was running (the controller must apply
    weights between generation batches only)."""
    applied_in_flight: list[bool] = field(default_factory=list)
    """ApplyWeightsRequest.in_flight of every ApplyWeights, in order. One with in_flight lands
    at once, also during a Generate: that call's samples report the version it brought as their
    last_policy_version, as the real generator's do."""
    max_running: int = 0
    """The most Generate calls that ran at once."""
    asleep: bool = False
    """In sleep mode (Sleep/WakeUp): Generate and ApplyWeights are refused, as vLLM's are."""
    calls: list[str] = field(default_factory=list)
    """Generate, ApplyWeights, Sleep and WakeUp calls, by name, in arrival order."""
    sleep_fails: int = 0
    """The next this many Sleep calls answer UNAVAILABLE."""
    wake_fails: int = 0
    """The next this many WakeUp calls answer UNAVAILABLE (and leave it asleep)."""
    _running: int = 0
    _count_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def generating(self) -> bool:
        """A Generate call is running now."""
        with self._count_lock:
            return self._running > 0

    def Generate(
        self, request: generator_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generator_pb2.GenerateResponse:
        self.calls.append("Generate")
        self._refuse_asleep(context)
        with self._count_lock:
            self._running += 1
            self.max_running = max(self.max_running, self._running)
        try:
            return self._generate(request)
        finally:
            with self._count_lock:
                self._running -= 1

    def _generate(self, request: generator_pb2.GenerateRequest) -> generator_pb2.GenerateResponse:
        if self.on_generate is not None:
            self.on_generate()
        first = self.version
        time.sleep(self.generate_seconds)
        samples = []
        for prompt in request.prompts:
            self.generated.append(prompt.id)
            for index in range(request.sampling.n):
                text = self.complete(prompt, index)
                tokens = [ord(c) % 100 for c in text] or [0]
                samples.append(
                    common_pb2.Sample(
                        prompt_id=prompt.id,
                        index=index,
                        prompt_token_ids=[ord(c) % 100 for c in prompt.text],
                        token_ids=tokens,
                        text=text,
                        logprobs=[-0.5] * len(tokens),
                        finish_reason=common_pb2.FINISH_REASON_STOP,
                        policy_version=first
                        if self.version_of is None
                        else self.version_of(prompt.id, first),
                        last_policy_version=self.version if self.version_of is None else 0,
                    )
                )
        return generator_pb2.GenerateResponse(samples=samples)

    def ApplyWeights(
        self, request: generator_pb2.ApplyWeightsRequest, context: grpc.ServicerContext
    ) -> generator_pb2.ApplyWeightsResponse:
        self.calls.append("ApplyWeights")
        if self.on_apply is not None:
            self.on_apply()
        self._refuse_asleep(context)
        self.applied.append(request.manifest)
        self.applied_in_flight.append(request.in_flight)
        with self._count_lock:
            self.overlaps += self._running > 0
        if request.manifest.version_only and self.weight_state == "needs_full":
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "the generator needs a full manifest"
            )
        self.version, self.weight_state = request.manifest.version, "idle"
        return generator_pb2.ApplyWeightsResponse(
            policy_version=self.version, in_flight=request.in_flight
        )

    def Info(
        self, request: common_pb2.InfoRequest, context: grpc.ServicerContext
    ) -> generator_pb2.GeneratorInfo:
        return generator_pb2.GeneratorInfo(
            policy_version=self.version, weight_state=self.weight_state, sleeping=self.asleep
        )

    def Sleep(
        self, request: generator_pb2.SleepRequest, context: grpc.ServicerContext
    ) -> generator_pb2.SleepResponse:
        self.calls.append("Sleep")
        if self.sleep_fails:
            self.sleep_fails -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected Sleep failure")
        self.asleep = True
        return generator_pb2.SleepResponse()

    def WakeUp(
        self, request: generator_pb2.WakeUpRequest, context: grpc.ServicerContext
    ) -> generator_pb2.WakeUpResponse:
        self.calls.append("WakeUp")
        if self.wake_fails:
            self.wake_fails -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "injected WakeUp failure")
        self.asleep = False
        return generator_pb2.WakeUpResponse()

    def _refuse_asleep(self, context: grpc.ServicerContext) -> None:
        if self.asleep:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "the generator is asleep; call WakeUp first"
            )


class FakePod:
    """A fake trainer and generator on one gRPC server (one port)."""

    def __init__(self, checkpoint_dir: Path, pod_id: str = "pod-0", **trainer: object) -> None:
        self.id = pod_id
        self.trainer = FakeTrainer(checkpoint_dir, pod_id=pod_id, **trainer)  # type: ignore[arg-type]
        self.generator = FakeGenerator()
        self.trainer.generator = self.generator
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        trainer_pb2_grpc.add_TrainerServicer_to_server(self.trainer, self.server)
        generator_pb2_grpc.add_GeneratorServicer_to_server(self.generator, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    @property
    def pod(self) -> Pod:
        """The pod as the roster sees it (its grader is the test's own; unused here)."""
        return Pod(self.id, self.address, self.address, self.address)

    def stop(self) -> None:
        self.server.stop(grace=None)

    def kill(self) -> None:
        """As SIGKILL: the pod's calls in flight break and it answers nothing any more."""
        self.trainer.dead = True
        self.server.stop(grace=None)
