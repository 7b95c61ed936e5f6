"""A real local cluster (the four service processes on loopback), shared by the foundation tests
(one vLLM engine start for all of them)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from podrl.cli.local_cluster import LocalCluster
from podrl.config import load_config


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    run_dir = tmp_path_factory.mktemp("run")
    config = load_config(env={**os.environ, "PODRL_RUN_DIR": str(run_dir)})
    local = LocalCluster(config, None)
    local.start()
    try:
        local.wait_ready(timeout=300)
        yield local
    finally:
        local.stop(grace=15)
