"""Moving a new policy version from the trainer to every generator.

``PublishWeights`` on the trainer → ``ApplyWeights`` on every healthy generator (in parallel) →
``AcknowledgeWeights`` on the trainer, which may then update the published storage again.
A generator that answers FAILED_PRECONDITION to a version-only manifest (restarted, no cached
plan) is sent a full manifest. The trainer already holds the version when a sync runs, so a
failed sync is retried on its own, never by redoing the step.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from podrl.controller import loop_metrics as metrics
from podrl.controller.clients import WorkerClients, fan_out
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
        trainer_address: Callable[[], str],
        generators: Callable[[], list[str]],
        stop: threading.Event | None = None,
    ) -> None:
        self._clients = clients
        self._pool = pool
        self._trainer_address = trainer_address
        self._generators = generators
        self.stop = stop or threading.Event()
        """Set when the run stops: retries end early."""

    def sync(
        self,
        version: int,
        force_full: bool = False,
        generators: list[str] | None = None,
        rollback: bool = False,
    ) -> None:
        """Trainer publishes, the generators (all healthy ones by default) apply, the trainer
        hears the acknowledgment. ``rollback``: the generators may hold a newer version (the
        trainer went back to a checkpoint)."""
        trainer = self._clients.trainer(self._trainer_address())
        targets = self._generators() if generators is None else generators
        manifest = self._publish(trainer, version, force_full or rollback)
        full = [manifest] if not manifest.version_only else []
        full_lock = threading.Lock()

        def full_manifest() -> weights_pb2.WeightManifest:
            with full_lock:  # one full publish, however many generators need it
                if not full:
                    full.append(self._publish(trainer, version, force_full=True))
                return full[0]

        def apply(address: str) -> None:
            stub = self._clients.generator(address)
            request = generator_pb2.ApplyWeightsRequest(manifest=manifest, rollback=rollback)
            try:
                stub.ApplyWeights(request, timeout=self._clients.long)
                return
            except grpc.RpcError as err:
                # A restarted or new generator has no cached plan: send it the full manifest.
                if err.code() != grpc.StatusCode.FAILED_PRECONDITION or not manifest.version_only:
                    raise StepFailedError(
                        "sync", f"generator {address}: {describe_rpc_error(err)}"
                    ) from err
            request = generator_pb2.ApplyWeightsRequest(manifest=full_manifest())
            try:
                stub.ApplyWeights(request, timeout=self._clients.long)
            except grpc.RpcError as err:
                raise StepFailedError(
                    "sync", f"generator {address}: {describe_rpc_error(err)}"
                ) from err

        fan_out(self._pool, [lambda a=a: apply(a) for a in targets])
        self._acknowledge(trainer, version)

    def _publish(
        self, trainer: trainer_pb2_grpc.TrainerStub, version: int, force_full: bool
    ) -> weights_pb2.WeightManifest:
        try:
            published = trainer.PublishWeights(
                trainer_pb2.PublishWeightsRequest(force_full=force_full),
                timeout=self._clients.long,
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "sync", f"trainer PublishWeights: {describe_rpc_error(err)}"
            ) from err
        if published.manifest.version != version:
            raise StepFailedError(
                "sync",
                f"trainer published version {published.manifest.version}, expected {version}",
            )
        return published.manifest

    def _acknowledge(self, trainer: trainer_pb2_grpc.TrainerStub, version: int) -> None:
        try:
            trainer.AcknowledgeWeights(
                trainer_pb2.AcknowledgeWeightsRequest(version=version, generator_id="controller"),
                timeout=self._clients.short,
            )
        except grpc.RpcError as err:
            raise StepFailedError(
                "sync", f"trainer AcknowledgeWeights: {describe_rpc_error(err)}"
            ) from err

    def sync_with_retries(self, version: int, attempts: int) -> None:
        """The trainer already holds ``version``: a failed sync is retried on its own (redoing
        the step would train on its prompts twice). Republishing a pending version is allowed,
        and a generator that already applied it answers the retry with success."""
        for attempt in range(1, attempts + 1):
            try:
                self.sync(version)
                return
            except StepFailedError as err:
                metrics.STEP_FAILURES.labels("sync").inc()
                log.error("weight sync of version %d, attempt %d failed: %s", version, attempt, err)
                if attempt == attempts or self.stop.is_set():
                    raise RunFailedError(
                        f"weight sync of version {version} failed {attempt} times ({err}); a "
                        "restart resumes after the trained step and re-syncs the generators"
                    ) from err
                self.stop.wait(min(2.0 * attempt, 10.0))

    def bring_generators_to(self, version: int) -> None:
        """Generators that do not serve ``version`` get a full manifest of it (those ahead of
        the trainer roll back), and so do those whose weights are unsettled (``weight_state``
        needs_full or applying: a failed or overrun apply; they refuse Generate and every
        version-only manifest until a full one lands). The trainer is acknowledged in any case,
        so a version whose acknowledgement was lost (e.g. the controller died mid-sync) cannot
        block it."""
        behind: list[str] = []
        ahead: list[str] = []
        for address in self._generators():
            try:
                info = self._clients.generator(address).Info(
                    common_pb2.InfoRequest(), timeout=self._clients.short
                )
            except grpc.RpcError as err:
                raise StepFailedError(
                    "sync", f"generator {address} Info: {describe_rpc_error(err)}"
                ) from err
            if info.policy_version > version:
                ahead.append(address)  # a rollback sends a full manifest in any state
            elif info.policy_version < version or info.weight_state in _UNSETTLED:
                behind.append(address)
        if behind:
            log.info("generators %s are behind version %d: full weight sync", behind, version)
            self.sync(version, force_full=True, generators=behind)
        if ahead:
            log.warning(
                "generators %s are ahead of the trainer (version %d): rollback", ahead, version
            )
            self.sync(version, generators=ahead, rollback=True)
        if not behind and not ahead:
            self._acknowledge(self._clients.trainer(self._trainer_address()), version)
