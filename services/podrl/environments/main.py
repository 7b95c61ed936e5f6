"""``python -m podrl.environments``: the environment service process."""

from __future__ import annotations

from collections.abc import Sequence

from podrl.common.service import PrometheusServer, ServiceSpec, serve
from podrl.config import RunConfig
from podrl.environments.isolation import resolve_environments
from podrl.environments.servicer import EnvironmentServicer
from podrl.grader.servicer import WorkerPool
from podrl.v1 import environment_pb2_grpc


def build_spec(config: RunConfig) -> ServiceSpec:
    # Every environment is resolved and checked here, before the server starts: a bad plug-in
    # stops the service with a ConfigError naming the field (exit code 2).
    specs = resolve_environments(config.environments)
    section = config.environments
    pool = WorkerPool(
        section.workers,
        section.start_method,
        preload=sorted(
            {
                "podrl.environments.isolation",
                *(spec.path.partition(":")[0] for spec in specs.values()),
            }
        ),
        memory_limit_mib=section.worker_memory_mib,
    )
    pool.warm_up()
    servicer = EnvironmentServicer(config, specs, pool)
    return ServiceSpec(
        name="environments",
        grpc_service="podrl.v1.Environment",
        section=section,
        # Not registered with the controller: no part of the loop calls environments yet.
        component=None,
        add_servicers=lambda server: environment_pb2_grpc.add_EnvironmentServicer_to_server(
            servicer, server
        ),
        side_servers=[
            PrometheusServer(section.bind_host, section.metrics_port, "environments.metrics_port")
        ],
        on_close=[pool.close],
    )


def main(argv: Sequence[str] | None = None) -> int:
    return serve("environments", build_spec, argv)
