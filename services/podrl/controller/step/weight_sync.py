"""Moving a new policy version from each pod's trainer to that pod's generator.

Weight sync stays inside a pod: a pod's trainer publishes shared-memory (CPU) or CUDA IPC (GPU)
handles that only its own generator can open, and that generator trusts only its own pod's
trainer. So for every pod, in parallel: ``PublishWeights`` on its trainer → ``ApplyWeights`` on
its generator → ``AcknowledgeWeights`` on its trainer, which may then update the published
storage again. The cost of a sync does not grow with the number of pods.

A generator that answers FAILED_PRECONDITION to a version-only manifest (restarted, no cached
plan, or needing a full manifest) is sent a full manifest. The trainers already hold the version
when a sync runs, so a failed sync is retried on its own, never by redoing the step; a pod that
is lost meanwhile is left out (its generator is aligned by a full manifest when it is admitted
again).

With ``loop.generator_memory: sleep_during_train`` (one accelerator shared by a pod's trainer
and generator) the generators sleep before Train (:meth:`WeightSync.sleep_pods`) and wake before
the sync (:meth:`WeightSync.wake_pods`, retried on its own as the sync is).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

import grpc

from podrl.controller import loop_metrics as metrics
from podrl.controller.pods.clients import WorkerClients
from podrl.controller.pods.roster import Pod
from podrl.controller.step_errors import RunFailedError, StepFailedError, describe_rpc_error
from podrl.v1 import common_pb2, generator_pb2, trainer_pb2, trainer_pb2_grpc, weights_pb2

log = logging.getLogger(__name__)

#: GeneratorInfo.weight_state values of a generator that serves no settled version.
_UNSETTLED = ("needs_full", "applying")


class WeightSync:
    def __init__(
        self,
        clients: WorkerClients,
        pool: ThreadPoolExecutor,
        stop: threading.Event | None = None,
        applying: Callable[[], AbstractContextManager[object]] = nullcontext,
        in_flight: bool = False,
    ) -> None:
        self._clients = clients
        self._pool = pool
        self.stop = stop or threading.Event()
        """Set when the run stops: retries end early."""
        self._applying = applying
        """Held around every ``ApplyWeights`` (async mode: the loop's side of the generator
        gate, so a generator is never given weights in the middle of a batch); the trainers'
        publish and acknowledgment run outside it."""
        self.in_flight = in_flight
        """``loop.weight_apply: in_flight``: every ApplyWeights but a rollback asks the
        generator to apply while its Generate calls run, and holds nothing here."""

    def sync(
        self, pod: Pod, version: int, force_full: bool = False, rollback: bool = False
    ) -> None:
        """The pod's trainer publishes, its generator applies, the trainer hears the
        acknowledgment. ``rollback``: the generator may hold a newer version (the trainer went
        back to a checkpoint)."""
        trainer = self._clients.trainer(pod.trainer)
        manifest = self._publish(pod, trainer, version, force_full or rollback)
        in_flight = self.in_flight and not rollback  # a rollback lands between batches
        with nullcontext() if in_flight else self._applying():
            self._apply(pod, trainer, version, manifest, rollback, in_flight)
        self._acknowledge(pod, trainer, version)

    def _apply(
        self,
        pod: Pod,
        trainer: trainer_pb2_grpc.TrainerStub,
        version: int,
        manifest: weights_pb2.WeightManifest,
        rollback: bool,
        in_flight: bool,
    ) -> None:
        stub = self._clients.generator(pod.generator)
        request = generator_pb2.ApplyWeightsRequest(
            manifest=manifest, rollback=rollback, in_flight=in_flight
        )
        try:
            stub.ApplyWeights(request, timeout=self._clients.long)
        except grpc.RpcError as err:
            # A restarted or new generator has no cached plan: send it the full manifest.
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION or not manifest.version_only:
                raise StepFailedError(
                    "sync", f"generator {pod.generator}: {describe_rpc_error(err)}"
                ) from err
            full = self._publish(pod, trainer, version, force_full=True)
            try:
                stub.ApplyWeights(
                    generator_pb2.ApplyWeightsRequest(manifest=full, in_flight=in_flight),
                    timeout=self._clients.long,
                )
            except grpc.RpcError as err:
                raise StepFailedError(
                    "sync", f"generator {pod.generator}: {describe_rpc_error(err)}"
                ) from err

    def _publish(
        self, pod: Pod, trainer: trainer_pb2_grpc.TrainerStub, version: int, force_full: bool
    ) -> weights_pb2.WeightManifest:
        try:
            published = trainer.PublishWeights(
                trainer_pb2.PublishWeightsRequest(force_full=force_full),
                timeout=self._clients.long,
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "sync", f"trainer {pod.trainer} PublishWeights: {describe_rpc_error(err)}"
            ) from err
        if published.manifest.version != version:
            raise StepFailedError(
                "sync",
                f"trainer {pod.trainer} published version {published.manifest.version}, "
                f"expected {version}",
            )
        return published.manifest

    def _acknowledge(self, pod: Pod, trainer: trainer_pb2_grpc.TrainerStub, version: int) -> None:
        try:
            trainer.AcknowledgeWeights(
                trainer_pb2.AcknowledgeWeightsRequest(version=version, generator_id="controller"),
                timeout=self._clients.short,
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "sync", f"trainer {pod.trainer} AcknowledgeWeights: {describe_rpc_error(err)}"
            ) from err

    def sync_with_retries(
        self,
        pod: Pod,
        version: int,
        attempts: int,
        is_lost: Callable[[Pod], bool] = lambda pod: False,
        align: bool = False,
    ) -> float | None:
        """The trainer already holds ``version``: a failed sync is retried on its own (redoing
        the step would train on its prompts twice). Republishing a pending version is allowed,
        and a generator that already applied it answers the retry with success. ``align``: the
        generator's version is unknown (its pod just joined): :meth:`bring_generator_to`.
        Returns the seconds of the sync that succeeded, or None when ``is_lost(pod)`` says the
        pod is gone (it is aligned when admitted again)."""

        def attempt() -> None:
            if align:
                self.bring_generator_to(pod, version)
            else:
                self.sync(pod, version)

        return self._retried(
            "sync",
            f"weight sync of version {version}",
            "a restart resumes after the trained step and re-syncs the generators",
            pod,
            attempts,
            is_lost,
            attempt,
        )

    def _retried(
        self,
        phase: str,
        what: str,
        after_failure: str,
        pod: Pod,
        attempts: int,
        is_lost: Callable[[Pod], bool],
        call: Callable[[], None],
    ) -> float | None:
        """``call`` until it succeeds (its seconds), the pod is lost (None), or ``attempts``
        failures (RunFailedError naming ``what`` and ``after_failure``); each failure counts
        as one of ``phase``."""
        for attempt in range(1, attempts + 1):
            start = time.perf_counter()
            try:
                call()
                return time.perf_counter() - start
            except StepFailedError as err:
                metrics.STEP_FAILURES.labels(phase).inc()
                log.error("%s on pod %s, attempt %d failed: %s", what, pod.id, attempt, err)
                if is_lost(pod):
                    log.warning("pod %s is gone: its %s is dropped", pod.id, what)
                    return None
                if attempt == attempts or self.stop.is_set():
                    raise RunFailedError(
                        f"{what} on pod {pod.id} failed {attempt} times ({err}); {after_failure}"
                    ) from err
                self.stop.wait(min(2.0 * attempt, 10.0))
        raise AssertionError("unreachable: the loop returns or raises")

    def sync_pods(
        self,
        pods: list[Pod],
        version: int,
        attempts: int,
        is_lost: Callable[[Pod], bool] = lambda pod: False,
        align: frozenset[str] = frozenset(),
    ) -> dict[str, float]:
        """Every pod syncs its own generator, all at once (those in ``align`` by
        :meth:`bring_generator_to`). Pod id → seconds of its sync (pods lost meanwhile are
        left out)."""
        return self._every_pod(
            pods,
            lambda pod: self.sync_with_retries(pod, version, attempts, is_lost, pod.id in align),
        )

    def wake_pods(
        self, pods: list[Pod], attempts: int, is_lost: Callable[[Pod], bool] = lambda pod: False
    ) -> dict[str, float]:
        """Every pod's generator wakes from sleep mode (a no-op for one awake), all at once,
        each retried on its own as a sync is: the trainers already trained the step. Pod id →
        seconds (pods lost meanwhile are left out)."""
        return self._every_pod(
            pods,
            lambda pod: self._retried(
                "wake",
                "WakeUp",
                "a restart wakes the generators before the next step",
                pod,
                attempts,
                is_lost,
                lambda: self.wake(pod),
            ),
        )

    def _every_pod(self, pods: list[Pod], call: Callable[[Pod], float | None]) -> dict[str, float]:
        futures = {pod.id: self._pool.submit(call, pod) for pod in pods}
        seconds: dict[str, float] = {}
        failure: BaseException | None = None
        for pod_id, future in futures.items():
            try:
                result = future.result()
            except BaseException as err:  # every pod's call ends before the failure is raised
                failure = failure or err
                continue
            if result is not None:
                seconds[pod_id] = result
        if failure is not None:
            raise failure
        return seconds

    def sleep_pods(self, pods: list[Pod], level: int = 1) -> None:
        """Every pod's generator goes to sleep (vLLM sleep mode), all at once, before Train
        (``loop.generator_memory: sleep_during_train``). Any failure fails the step attempt
        (StepFailedError, phase ``sleep``): nothing is trained yet, and the retry's align
        wakes the generators that did fall asleep."""
        futures = [self._pool.submit(self._sleep_one, pod, level) for pod in pods]
        outcomes = [future.result() for future in futures]
        failures = [
            f"generator {pod.generator}: {outcome}"
            for pod, outcome in zip(pods, outcomes, strict=True)
            if outcome is not None
        ]
        if failures:
            raise StepFailedError("sleep", "; ".join(failures))

    def _sleep_one(self, pod: Pod, level: int) -> str | None:
        try:
            self._clients.generator(pod.generator).Sleep(
                generator_pb2.SleepRequest(level=level), timeout=self._clients.long
            )
        except grpc.RpcError as err:
            return describe_rpc_error(err)
        return None

    def wake(self, pod: Pod) -> None:
        """The pod's generator leaves sleep mode (WakeUp is a no-op for one awake)."""
        try:
            self._clients.generator(pod.generator).WakeUp(
                generator_pb2.WakeUpRequest(), timeout=self._clients.long
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "wake", f"generator {pod.generator} WakeUp: {describe_rpc_error(err)}"
            ) from err

    def bring_generator_to(self, pod: Pod, version: int) -> None:
        """The pod's generator gets a full manifest of ``version`` from its trainer when it
        does not serve it (one ahead of the trainer rolls back), and so does one whose weights
        are unsettled (``weight_state`` needs_full or applying: a failed or overrun apply; it
        refuses Generate and every version-only manifest until a full one lands). The trainer
        is acknowledged in any case, so a version whose acknowledgement was lost (e.g. the
        controller died mid-sync) cannot block it. A generator asleep (a step that slept it
        for Train failed, or the controller restarted meanwhile) is woken first: it must
        generate next."""
        try:
            info = self._clients.generator(pod.generator).Info(
                common_pb2.InfoRequest(), timeout=self._clients.short
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "sync", f"generator {pod.generator} Info: {describe_rpc_error(err)}"
            ) from err
        if info.sleeping:
            log.info("generator of pod %s is asleep: waking it", pod.id)
            self.wake(pod)
        if info.policy_version > version:
            log.warning(
                "generator of pod %s is ahead of its trainer (version %d): rollback",
                pod.id,
                version,
            )
            self.sync(pod, version, rollback=True)  # a rollback sends a full manifest
        elif info.policy_version < version or info.weight_state in _UNSETTLED:
            log.info("generator of pod %s is behind version %d: full weight sync", pod.id, version)
            self.sync(pod, version, force_full=True)
        else:
            self._acknowledge(pod, self._clients.trainer(pod.trainer), version)
