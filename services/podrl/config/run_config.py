"""The run config: one model for the whole run.

One YAML file (``podrl run CONFIG`` / ``--config``) describes the whole run; every service reads
the same file and uses its own section. Any field can be overridden from the environment as
``PODRL_<SECTION>__<FIELD>`` (e.g. ``PODRL_GENERATOR__GRPC_PORT=6000``), which is how the local
launcher, docker-compose and the Helm chart assign ports and addresses.

Each section lives in its own module (``podrl.config.<section>``). Knobs of different sections
that must agree (sampling vs logprobs, loss normalisers vs the generation budget, the schedule vs
the run length, prompt + completion vs the model length) are derived or checked once, here, by
``podrl.config.coupling`` (rules: docs/config.md).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from podrl.config.auth import AuthConfig
from podrl.config.base import Section, ServiceSection
from podrl.config.controller import ControllerConfig
from podrl.config.coupling import apply_coupling_rules
from podrl.config.environments import EnvironmentsConfig
from podrl.config.generator import GeneratorConfig
from podrl.config.grader import GraderConfig
from podrl.config.loop import LoopConfig, SamplingConfig
from podrl.config.tasks import TasksConfig
from podrl.config.tracking import TrackingConfig
from podrl.config.trainer import TrainerConfig
from podrl.config.transport import GrpcConfig, LogConfig

__all__ = [
    "AuthConfig",
    "ControllerConfig",
    "EnvironmentsConfig",
    "GeneratorConfig",
    "GraderConfig",
    "GrpcConfig",
    "LogConfig",
    "LoopConfig",
    "RunConfig",
    "SamplingConfig",
    "ServiceSection",
    "TrainerConfig",
]


class RunConfig(Section):
    """The whole run. Every field has a working default for a local CPU run."""

    name: str = Field("podrl", min_length=1, description="Run name (status pages, metrics).")
    run_dir: Path = Field(
        Path("runs/podrl"), description="Checkpoints, samples, logs and metrics history go here."
    )
    worker_id: str = Field(
        default_factory=socket.gethostname,
        min_length=1,
        description="The worker pod this process belongs to (the pod name on k8s).",
    )
    device: Literal["cpu", "cuda", "auto"] = Field(
        "auto", description="cpu, cuda, or auto (cuda when available)."
    )
    compile_cache_dir: Path | None = Field(
        None,
        description="Folder where the trainer's torch.compile caches (inductor, Triton) and "
        "the generator's vLLM cache (its torch.compile cache) persist across runs, so a "
        "warm start skips compiling; unset = <XDG_CACHE_HOME or ~/.cache>/podrl/compile. "
        "Variables the environment already sets (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, "
        "VLLM_CACHE_ROOT) win. The Helm chart mounts a volume here "
        "(workers.compileCache).",
    )
    grpc: GrpcConfig = Field(default_factory=GrpcConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    grader: GraderConfig = Field(default_factory=GraderConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    loop: LoopConfig = Field(default_factory=LoopConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    environments: EnvironmentsConfig = Field(default_factory=EnvironmentsConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    def compile_cache_env(self, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The variables that point torch's and vLLM's compile caches into
        ``compile_cache_dir``, less those ``environ`` (default: this process's) already sets."""
        environ = os.environ if environ is None else environ
        root = self.compile_cache_dir
        if root is None:
            home = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
            root = Path(home) / "podrl" / "compile"
        wanted = {
            "TORCHINDUCTOR_CACHE_DIR": root / "inductor",
            "TRITON_CACHE_DIR": root / "triton",
            "VLLM_CACHE_ROOT": root / "vllm",
        }
        return {name: str(path) for name, path in wanted.items() if not environ.get(name)}

    @model_validator(mode="after")
    def _couple_sections(self) -> RunConfig:
        # Derives unset dependent fields in place, or raises CoupledFieldsError (a ValueError,
        # so pydantic reports it as a validation error) naming both fields of each conflict.
        apply_coupling_rules(self)
        return self
