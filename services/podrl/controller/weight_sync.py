"""Moving a new policy version from the trainer to every generator.

``PublishWeights`` on the trainer → ``ApplyWeights`` on every healthy generator (in parallel) →
``AcknowledgeWeights`` on the trainer, which may then update the published storage again.
A generator that answers FAILED_PRECONDITION to a version-only manifest (restarted, no cached
plan) is sent a full manifest. The trainer already holds the version when a sync runs, so a
failed sync is retried on its own, never by redoing the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from podrl.controller import loop_metrics as metrics
from podrl.controller.clients import WorkerClients
from podrl.controller.step_errors import RunFailedError, StepFailedError, describe_rpc_error
from podrl.v1 import common_pb2, generator_pb2, trainer_pb2

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(
        self,
        clients: WorkerClients,
        pool: ThreadPoolExecutor,
        trainer_address: Callable[[], str],
        generators: Callable[[], list[str]],
    ) -> None:
        self._clients = clients
        self._pool = pool
        self._trainer_address = trainer_address
        self._generators = generators

    def _fan_out(self, calls: list[Callable[[], None]]) -> None:
        for future in [self._pool.submit(call) for call in calls]:
            future.result()

    def sync(self, version: int, force_full: bool = False) -> None:
        """Trainer publishes, every generator applies, trainer hears the acknowledgment."""
        trainer = self._clients.trainer(self._trainer_address())
        generators = self._generators()
        try:
            published = trainer.PublishWeights(
                trainer_pb2.PublishWeightsRequest(force_full=force_full),
                timeout=self._clients.long,
            )
        except grpc.RpcError as err:
            raise StepFailedError("sync", f"PublishWeights: {describe_rpc_error(err)}") from err
        manifest = published.manifest
        if manifest.version != version:
            raise StepFailedError(
                "sync", f"trainer published version {manifest.version}, expected {version}"
            )
        full: list[generator_pb2.ApplyWeightsRequest] = []

        def full_manifest() -> generator_pb2.ApplyWeightsRequest:
            if not full:
                reply = trainer.PublishWeights(
                    trainer_pb2.PublishWeightsRequest(force_full=True), timeout=self._clients.long
                )
                full.append(generator_pb2.ApplyWeightsRequest(manifest=reply.manifest))
            return full[0]

        def apply(address: str) -> None:
            stub = self._clients.generator(address)
            request = generator_pb2.ApplyWeightsRequest(manifest=manifest)
            try:
                stub.ApplyWeights(request, timeout=self._clients.long)
            except grpc.RpcError as err:
                # A restarted or new generator has no cached plan: send it the full manifest.
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION or not manifest.version_only:
                    raise StepFailedError(
                        "sync", f"generator {address}: {describe_rpc_error(err)}"
                    ) from err
                try:
                    stub.ApplyWeights(full_manifest(), timeout=self._clients.long)
                except grpc.RpcError as err2:
                    raise StepFailedError(
                        "sync", f"generator {address}: {describe_rpc_error(err2)}"
                    ) from err2

        self._fan_out([lambda a=a: apply(a) for a in generators])
        try:
            trainer.AcknowledgeWeights(
                trainer_pb2.AcknowledgeWeightsRequest(version=version, generator_id="controller"),
                timeout=self._clients.short,
            )
        except grpc.RpcError as err:
            raise StepFailedError("sync", f"AcknowledgeWeights: {describe_rpc_error(err)}") from err

    def sync_with_retries(self, version: int, attempts: int) -> None:
        """The trainer already holds ``version``: a failed sync is retried on its own (redoing
        the step would train on its prompts twice). Republishing a pending version is allowed."""
        for attempt in range(1, attempts + 1):
            try:
                self.sync(version)
                return
            except StepFailedError as err:
                metrics.STEP_FAILURES.labels("sync").inc()
                log.error("weight sync of version %d, attempt %d failed: %s", version, attempt, err)
                if attempt == attempts:
                    raise RunFailedError(
                        f"weight sync of version {version} failed {attempt} times ({err}); a "
                        "restart resumes after the trained step and re-syncs the generators"
                    ) from err
                time.sleep(min(2.0 * attempt, 10.0))

    def bring_generators_to(self, version: int) -> None:
        """Generators whose policy version is not ``version`` get a full manifest."""
        behind = []
        for address in self._generators():
            info = self._clients.generator(address).Info(
                common_pb2.InfoRequest(), timeout=self._clients.short
            )
            if info.policy_version != version:
                behind.append(address)
        if behind:
            log.info("generators %s are behind version %d: full weight sync", behind, version)
            self.sync(version, force_full=True)
