"""The run's status: one model served as REST JSON and as the gRPC RunStatus message."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, Field

from podrl.config.loop import LoopConfig
from podrl.controller.pods.table import PodTable
from podrl.controller.rollout.producer import buffer_capacity_steps
from podrl.v1 import controller_pb2

_COMPONENT_BY_NAME = {"generator": 1, "grader": 2, "trainer": 3}
_STATE_BY_NAME = {"starting": 1, "serving": 2, "draining": 3, "gone": 4}


class WorkerView(BaseModel):
    worker_id: str = Field(description="Worker pod the process belongs to.")
    component: str = Field(description="generator, grader or trainer.")
    address: str = Field(description="host:port of its gRPC server.")
    state: str = Field(description="starting, serving, draining or gone.")
    healthy: bool = Field(description="Serving and heard from within the heartbeat timeout.")
    seconds_since_heartbeat: float
    policy_version: int


class PodView(BaseModel):
    id: str = Field(description="The pod's worker id (its StatefulSet pod name; local-N locally).")
    state: str = Field(
        description="training (in the current step), joining (admitted; its trainer heals from "
        "a peer in its first Train), waiting (admitted at the next step), draining, incomplete "
        "(a service missing or unhealthy) or gone."
    )
    policy_version: int | None = Field(description="Its trainer's policy version.")
    share: int = Field(description="Prompts of the current step generated and scored on it.")
    train_sequences: int = Field(description="Sequences of the current step it trains on.")


class RolloutView(BaseModel):
    mode: str = Field("sync", description="loop.mode: sync or async.")
    max_staleness: int | None = Field(
        None, description="loop.max_staleness in async mode (null in sync mode)."
    )
    buffer_steps: int = Field(0, description="Scored steps waiting in the rollout buffer.")
    buffer_groups: int = Field(0, description="Scored groups waiting in the rollout buffer.")
    buffer_capacity_groups: int = Field(
        0, description="Groups the buffer can hold: (max_staleness + 1) x prompts_per_step."
    )
    staleness_histogram: dict[str, int] = Field(
        default_factory=dict,
        description="Versions behind (between sampling and training) → groups trained on, "
        "over the run's recorded steps.",
    )
    groups_dropped_stale: int = Field(
        0, description="Groups dropped as older than max_staleness versions, over the run."
    )
    samples_dropped_stale: int = Field(0, description="Their samples.")
    weight_apply: str | None = Field(
        None, description="loop.weight_apply in async mode: between_batches or in_flight."
    )
    samples_spanning_versions: int = Field(
        0,
        description="Samples of the groups kept that more than one policy version sampled (a "
        "weight update landed in flight while they ran), over the run.",
    )

    @classmethod
    def of(cls, loop: LoopConfig) -> RolloutView:
        """The run's rollout settings: async mode's buffer; empty in sync mode."""
        if loop.mode != "async":
            return cls()
        return cls(
            mode="async",
            max_staleness=loop.max_staleness,
            buffer_capacity_groups=buffer_capacity_steps(loop.max_staleness)
            * loop.prompts_per_step,
            weight_apply=loop.weight_apply,
        )


class EpisodeFiguresView(BaseModel):
    """The episodes of a run whose tasks name an environment, live: the episode runner reports
    each start, turn and end as it happens (``controller/rollout/episode_figures.py``)."""

    in_flight: int = Field(0, description="Episodes being played now.")
    finished: int = Field(0, description="Episodes played to their end, over the run.")
    failed: int = Field(
        0, description="Episodes the environment failed (never trained), over the run."
    )
    turns: int = Field(0, description="Turns played, over the run (those in flight included).")
    tool_calls: int = Field(0, description="Tool calls the environment ran, over the run.")
    tool_errors: int = Field(0, description="Tool calls that failed, over the run.")
    environment_seconds_mean: float | None = Field(
        None,
        description="The environment's time per turn (its Step, and Reset on the first "
        "turn) as the controller waited for it, over the run; null before the first turn.",
    )
    environment_seconds_max: float | None = Field(
        None, description="The longest of those waits; null before the first turn."
    )


class EpisodeTextView(BaseModel):
    """A text of an episode as the status shows it: cut and with its control characters
    escaped (``controller.episode_view_chars``)."""

    text: str = Field(description="The text's start, each control character as \\xNN or \\uNNNN.")
    chars: int = Field(description="Characters of the whole text.")
    truncated: bool = Field(description="The text shown is only the start of it.")


class EpisodeTurnView(BaseModel):
    action: EpisodeTextView = Field(description="What the model sampled: trained (mask 1).")
    sampled_tokens: int
    observation: EpisodeTextView = Field(
        description="The environment's reply: not trained (mask 0); empty on the last turn."
    )
    reply_tokens: int
    tool_calls: int
    tool_errors: int
    environment_seconds: float


class LatestEpisodeView(BaseModel):
    """The latest episode that ended (played to its end or failed by its environment)."""

    episode_id: str = Field(description="step:prompt id#index.")
    prompt_id: str
    prompt: EpisodeTextView = Field(
        description="The first turn's prompt (the task's prompt and Reset's observation)."
    )
    prompt_tokens: int
    turns: list[EpisodeTurnView]
    reward: float | None = Field(description="The environment's last reward; null when failed.")
    ended: str = Field(description="done, truncated, tokens, or empty when it failed.")
    error: EpisodeTextView | None = Field(description="Why the environment failed it.")


#: Drift warnings kept for the status (a run that drifts for long would grow the list).
MAX_WARNINGS = 20


class RunStatusView(BaseModel):
    run_name: str
    phase: str = Field(description="waiting_for_workers, idle, generate, score, train, sync, ...")
    step: int
    policy_version: int
    ready: bool = Field(description="Enough complete, healthy worker pods to run a step.")
    healthy_pods: list[str]
    epoch: int = Field(0, description="Changes of the set of pods that train (+1 at each).")
    desired_replicas: int | None = Field(
        None, description="Worker pods asked for (the StatefulSet's, or the local launcher's)."
    )
    pods: list[PodView] = Field(default_factory=list, description="Every known worker pod.")
    workers: list[WorkerView]
    phase_seconds: dict[str, float] = Field(description="Phase durations of the last step.")
    last_step_metrics: dict[str, Any] = Field(
        description="Reward, loss, KL, entropy, ... of the last step."
    )
    steps_total: int = Field(description="Steps the run is configured for (loop.steps).")
    error: str | None = Field(description="The last step or run error, if any.")
    last_checkpoint_error: dict[str, Any] | None = Field(
        None,
        description="The latest checkpoint save that failed, {step, error} (the trainer's "
        "status code and message, e.g. RESOURCE_EXHAUSTED for a full disk), kept after later "
        "saves; null when none failed. The run goes on and saves again at the next checkpoint "
        "step; the last good checkpoint stays.",
    )
    uptime_seconds: float
    last_eval: dict[str, Any] | None = Field(
        None, description="The latest held-out evaluation (as in /v1/evals), if any."
    )
    evaluations: int = Field(0, description="Held-out evaluations recorded so far.")
    rollout: RolloutView = Field(
        default_factory=RolloutView,
        description="The rollout buffer of async mode: fill, staleness, stale drops.",
    )
    episodes: EpisodeFiguresView | None = Field(
        None,
        description="Episodes of the tasks that name an environment, live (null when no task "
        "names one).",
    )
    warnings: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Policy-drift warnings of the run's recorded steps, the latest "
        f"{MAX_WARNINGS} at most, oldest first: {{step, figure, value, limit, side (high: "
        "above the max, low: below the min of loop.drift_warnings), knobs, message}.",
    )


class StepView(BaseModel):
    step: int
    policy_version: int
    epoch: int | None = Field(
        None, description="The pod table's epoch the step was trained in (null: not known)."
    )
    pods: list[str] | None = Field(
        None, description="The pods whose trainers applied the step (null: not known)."
    )
    finished_at: float = Field(description="Unix time the step finished.")
    metrics: dict[str, Any]

    @classmethod
    def of(
        cls, step: int, policy_version: int, finished_at: float, metrics: dict[str, Any]
    ) -> StepView:
        return cls(
            step=step,
            policy_version=policy_version,
            epoch=metrics.get("epoch"),
            pods=metrics.get("pods"),
            finished_at=finished_at,
            metrics=metrics,
        )


class RunState:
    """What the controller knows about the run; the loop updates it, status pages read it."""

    def __init__(
        self,
        run_name: str,
        table: PodTable,
        min_worker_pods: int,
        steps_total: int = 0,
        rollout: RolloutView | None = None,
    ) -> None:
        """``rollout``: the run's rollout settings (:meth:`RolloutView.of` its loop section)."""
        self.run_name = run_name
        self.table = table
        """Every pod fact and the epoch (status pages read them there)."""
        self.min_worker_pods = min_worker_pods
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self.step = 0
        self.policy_version = 0
        self._phase: Callable[[], str] = lambda: "idle"
        """Where the run's phase is read (the loop's: :meth:`follow_loop`)."""
        self.phase_seconds: dict[str, float] = {}
        self.last_step_metrics: dict[str, Any] = {}
        self.steps_total = steps_total
        self.error: str | None = None
        self.last_checkpoint_error: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None
        self.evaluations = 0
        self.rollout = rollout or RolloutView()
        self.warnings: list[dict[str, Any]] = []
        self._buffer_fill: Callable[[], tuple[int, int]] = lambda: (0, 0)
        """(steps, groups) in the rollout buffer (async mode's producer answers it)."""
        self._episodes: Callable[[], EpisodeFiguresView] | None = None
        self._latest_episode: Callable[[], LatestEpisodeView | None] = lambda: None

    def follow_loop(
        self, phase: Callable[[], str], buffer_fill: Callable[[], tuple[int, int]] | None = None
    ) -> None:
        """The loop owns the run's phase (generate, train, sync, ...) and, in async mode, the
        rollout buffer (``buffer_fill``: its steps and groups): status reads them there, so a
        step does not write them here."""
        with self._lock:
            self._phase = phase
            if buffer_fill is not None:
                self._buffer_fill = buffer_fill

    def follow_episodes(
        self,
        figures: Callable[[], EpisodeFiguresView],
        latest: Callable[[], LatestEpisodeView | None],
    ) -> None:
        """The episode runner's figures own the live episode figures and the latest episode
        (a run whose tasks name an environment): status reads them there."""
        with self._lock:
            self._episodes, self._latest_episode = figures, latest

    def latest_episode(self) -> LatestEpisodeView | None:
        """The latest episode that ended; None before one did, or when no task names an
        environment."""
        with self._lock:
            latest = self._latest_episode
        return latest()

    @property
    def phase(self) -> str:
        """waiting_for_workers, idle, generate, score, train, sync, ..., finished or failed."""
        with self._lock:
            phase = self._phase
        return phase()

    def set_error(self, error: str | None) -> None:
        with self._lock:
            self.error = error

    def set_checkpoint_error(self, failure: dict[str, Any] | None) -> None:
        with self._lock:
            self.last_checkpoint_error = dict(failure) if failure is not None else None

    def resume(self, step: int, policy_version: int) -> None:
        with self._lock:
            self.step, self.policy_version = step, policy_version

    def finish_step(
        self,
        step: int,
        policy_version: int,
        phase_seconds: dict[str, float],
        metrics: dict[str, Any],
    ) -> None:
        with self._lock:
            self.step, self.policy_version = step, policy_version
            self.phase_seconds = dict(phase_seconds)
            self.last_step_metrics = dict(metrics)
            self.error = None

    def count_staleness(self, figures: dict[str, Any]) -> None:
        """Add a step record's staleness figures to the run's totals."""
        with self._lock:
            histogram = dict(self.rollout.staleness_histogram)
            for lag, groups in (figures.get("staleness_histogram") or {}).items():
                histogram[lag] = histogram.get(lag, 0) + groups
            self.rollout = self.rollout.model_copy(
                update={
                    "staleness_histogram": dict(sorted(histogram.items(), key=lambda x: int(x[0]))),
                    "groups_dropped_stale": self.rollout.groups_dropped_stale
                    + (figures.get("groups_dropped_stale") or 0),
                    "samples_dropped_stale": self.rollout.samples_dropped_stale
                    + (figures.get("samples_dropped_stale") or 0),
                    "samples_spanning_versions": self.rollout.samples_spanning_versions
                    + (figures.get("samples_spanning_versions") or 0),
                }
            )

    def set_warnings(self, warnings: list[dict[str, Any]]) -> None:
        """The run's latest drift warnings (the recorder keeps at most MAX_WARNINGS)."""
        with self._lock:
            self.warnings = [dict(w) for w in warnings]

    def set_evaluations(self, last: dict[str, Any] | None, count: int) -> None:
        with self._lock:
            self.last_eval = dict(last) if last is not None else None
            self.evaluations = count

    def is_ready(self) -> bool:
        return len(self.table.healthy_pods()) >= self.min_worker_pods

    def view(self) -> RunStatusView:
        table = self.table
        pods = table.healthy_pods()
        ready = len(pods) >= self.min_worker_pods
        pod_views = [PodView(**{**vars(p), "state": p.state.value}) for p in table.status()]
        epoch = table.epoch
        desired = table.desired_replicas()
        with self._lock:
            buffer_fill, episodes = self._buffer_fill, self._episodes
        buffer_steps, buffer_groups = buffer_fill()
        episode_figures = None if episodes is None else episodes()
        with self._lock:
            rollout = self.rollout.model_copy(
                update={"buffer_steps": buffer_steps, "buffer_groups": buffer_groups}
            )
            phase = self._phase()
            if not ready and phase not in ("finished", "failed"):
                phase = "waiting_for_workers"
            return RunStatusView(
                run_name=self.run_name,
                phase=phase,
                step=self.step,
                policy_version=self.policy_version,
                ready=ready,
                healthy_pods=pods,
                epoch=epoch,
                desired_replicas=desired,
                pods=pod_views,
                workers=[WorkerView(**vars(m)) for m in table.members()],
                phase_seconds=dict(self.phase_seconds),
                last_step_metrics=dict(self.last_step_metrics),
                steps_total=self.steps_total,
                error=self.error,
                last_checkpoint_error=dict(self.last_checkpoint_error)
                if self.last_checkpoint_error is not None
                else None,
                uptime_seconds=round(time.monotonic() - self.started, 3),
                last_eval=dict(self.last_eval) if self.last_eval is not None else None,
                evaluations=self.evaluations,
                rollout=rollout,
                episodes=episode_figures,
                warnings=[dict(w) for w in self.warnings],
            )


def status_to_proto(view: RunStatusView) -> controller_pb2.RunStatus:
    return controller_pb2.RunStatus(
        run_name=view.run_name,
        phase=view.phase,
        step=view.step,
        policy_version=view.policy_version,
        ready=view.ready,
        workers=[
            controller_pb2.WorkerStatus(
                worker_id=w.worker_id,
                component=_COMPONENT_BY_NAME.get(w.component, 0),
                address=w.address,
                state=_STATE_BY_NAME.get(w.state, 0),
                healthy=w.healthy,
                seconds_since_heartbeat=w.seconds_since_heartbeat,
                policy_version=w.policy_version,
            )
            for w in view.workers
        ],
        phase_seconds=view.phase_seconds,
        uptime_seconds=view.uptime_seconds,
    )
