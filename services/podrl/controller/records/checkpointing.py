"""What the controller asks of the lead trainer about files: a checkpoint every
``loop.checkpoint_every`` steps and at the end, the resume at start (and after a restart), and
the Hugging Face export of the finished policy.

One pod's trainer (:meth:`PodTable.lead`) writes them: every replica holds the same
weights. Where a resumed run continues is decided by the pure rules of ``resume.py``; this
module asks the trainers and applies the plan.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from podrl.config import RunConfig
from podrl.controller.pods.table import PodTable
from podrl.controller.records.checkpoint_files import checkpoint_folder, newest_checkpoint
from podrl.controller.records.recorder import CHECKPOINT_ERROR_KEY, RunStore, StepRecorder
from podrl.controller.records.resume import (
    ControllerState,
    TrainerState,
    choose_checkpoint,
    plan_resume,
)
from podrl.controller.service.status import RunState
from podrl.controller.step.pod_calls import TrainPhase, WorkerClients
from podrl.controller.step_errors import RunFailedError, StepFailedError, describe_rpc_error
from podrl.tasks import TaskSource
from podrl.v1 import trainer_pb2

log = logging.getLogger(__name__)


class RunCheckpoints:
    def __init__(
        self,
        config: RunConfig,
        state: RunState,
        store: RunStore,
        clients: WorkerClients,
        source: TaskSource,
        recorder: StepRecorder,
        table: PodTable,
        train_phase: TrainPhase,
    ) -> None:
        self.config = config
        self.state = state
        self.store = store
        self.clients = clients
        self.source = source
        self.recorder = recorder
        self.table = table  # the pods, and the lead pod
        self.train_phase = train_phase  # asks the trainers' Info at resume
        # A failed save of an earlier controller of this run stays visible after a restart.
        state.set_checkpoint_error(store.get(CHECKPOINT_ERROR_KEY))

    def save(self, position: dict[str, Any]) -> str:
        """A checkpoint of the lead trainer, with the controller's step, version and the task
        source's ``position`` after the last recorded step; its path, or "" when it failed.

        A failed save (a full disk: the trainer answers RESOURCE_EXHAUSTED, having removed its
        partial folder) does not fail the run: training needs no disk, the previous checkpoint
        and the SQLite history still hold, and the next checkpoint step (or the run's end)
        saves again, which works once space is freed. The failure is logged, kept in the run
        store and shown as ``last_checkpoint_error`` in /v1/status and summary.json."""
        blob = ControllerState(self.state.step, self.state.policy_version, position).encode()
        try:
            reply = self.clients.trainer(self.table.lead().trainer).SaveCheckpoint(
                trainer_pb2.SaveCheckpointRequest(controller_state=blob), timeout=self.clients.long
            )
        except grpc.RpcError as err:
            error = describe_rpc_error(err)
            log.error(
                "checkpoint of step %d failed (the run goes on; the next checkpoint step saves "
                "again): %s",
                self.state.step,
                error,
            )
            failure = {"step": self.state.step, "error": error}
            self.store.put(CHECKPOINT_ERROR_KEY, failure)
            self.state.set_checkpoint_error(failure)
            self.state.set_error(f"checkpoint failed: {error}")
            return ""
        self.store.put("checkpoint", {"path": reply.path, "step": self.state.step})
        log.info("checkpoint of step %d at %s", self.state.step, reply.path)
        return reply.path

    def resume(self) -> None:
        """Line the controller's position up with the trainers' policy version (resume.py).

        The run's position is decided from the trainer that holds the newest version (the
        first by ordinal on a tie); trainers behind it heal from a peer in their next Train.
        When that trainer must go back to a checkpoint, so must every trainer ahead of the
        version it loads, or they would be taken for the newest replica. Generators are
        brought to the trainers' version (rolled back when ahead) and the trainers acknowledged
        by the first step's align."""
        pods = self.table.admit()
        if not pods:
            raise RunFailedError("no complete, healthy worker pod to resume the run with")
        trainer_info = self.train_phase.trainer_info
        infos = {pod.id: trainer_info(pod.trainer) for pod in pods}
        answering = [pod for pod in pods if infos[pod.id] is not None]
        if not answering:
            raise RunFailedError(f"trainer {pods[0].trainer} does not answer Info")
        lead = max(answering, key=lambda pod: (infos[pod.id].policy_version, -pods.index(pod)))
        info = infos[lead.id]
        assert info is not None
        trainer = TrainerState(
            info.policy_version, info.last_batch_id, info.last_train if info.last_batch_id else None
        )
        pending = self.store.pending()
        recorded = (self.store.get("checkpoint") or {}).get("path")
        on_disk = newest_checkpoint(checkpoint_folder(self.config))
        path = choose_checkpoint(
            trainer.policy_version,
            self.store,
            pending,
            recorded,
            str(on_disk) if on_disk else None,
        )
        loaded: ControllerState | None = None
        if path is not None:
            reply = self.clients.trainer(lead.trainer).LoadCheckpoint(
                trainer_pb2.LoadCheckpointRequest(path=path), timeout=self.clients.long
            )
            trainer = TrainerState(reply.policy_version)
            loaded = ControllerState.decode(reply.controller_state)
            log.info("trainer restored checkpoint %s (version %d)", path, reply.policy_version)
            for pod in answering:
                other = infos[pod.id]
                if (
                    pod is not lead
                    and other is not None
                    and other.policy_version > (reply.policy_version)
                ):
                    self.clients.trainer(pod.trainer).LoadCheckpoint(
                        trainer_pb2.LoadCheckpointRequest(path=path), timeout=self.clients.long
                    )
                    log.info("trainer of pod %s restored checkpoint %s too", pod.id, path)
        plan = plan_resume(self.store, pending, trainer, loaded, checkpoint_loaded=path is not None)
        if plan.recovered is not None:
            self.recorder.record_recovered(plan.recovered)
            log.warning(
                "step %d was trained before the controller stopped: recorded (%s)",
                plan.recovered.step,
                "trainer metrics from its stored reply"
                if plan.recovered.train_reply is not None
                else "its metrics are unknown",
            )
        self.store.clear_pending()
        records, rows = self.recorder.forget_steps_after(plan.last_step)
        if records or rows:
            log.warning(
                "forgot %d steps and %d sample rows after step %d (the trainer no longer has "
                "them; they run again)",
                records,
                rows,
                plan.last_step,
            )
        if plan.position is not None:
            self.source.restore(plan.position)
        self.state.resume(plan.last_step, plan.policy_version)
        if plan.last_step:
            log.info(
                "resuming after step %d at policy version %d (position from the %s)",
                plan.last_step,
                plan.policy_version,
                plan.source.replace("_", " "),
            )

    def export(self) -> None:
        """The finished policy as a Hugging Face folder, written by the lead trainer to
        <run_dir>/export (on the trainer's filesystem); a failure is recorded, not fatal."""
        path = self.config.run_dir / "export"
        try:
            reply = self.clients.trainer(self.table.lead().trainer).ExportHF(
                trainer_pb2.ExportHFRequest(path=str(path)), timeout=self.clients.long
            )
        except (grpc.RpcError, StepFailedError) as err:
            error = describe_rpc_error(err) if isinstance(err, grpc.RpcError) else str(err)
            log.error("export of policy version %d failed: %s", self.state.policy_version, error)
            self.store.put("export", {"path": None, "error": error, "step": self.state.step})
            return
        self.store.put(
            "export",
            {
                "path": reply.path,
                "files": list(reply.files),
                "step": self.state.step,
                "policy_version": self.state.policy_version,
                "error": None,
            },
        )
        log.info("policy version %d exported to %s", self.state.policy_version, reply.path)
