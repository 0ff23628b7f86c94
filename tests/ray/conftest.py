"""Fixtures of the Ray executor tests: one small local Ray cluster (2 CPUs, 200 MB object store)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

# Workers inherit the environment of the cluster: one thread each (as in this process, so the
# local and Ray runs compute with the same kernels), no usage reporting, no log forwarding noise.
QUIET_ENV = {
    "OMP_NUM_THREADS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
NUM_CPUS = 2
OBJECT_STORE_BYTES = 200 * 1024 * 1024


def start_cluster() -> Any:
    """Start a fresh local cluster with the machine's 2 CPUs and a small object store."""
    import ray

    os.environ.update(QUIET_ENV)
    ray.init(num_cpus=NUM_CPUS, object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    return ray


@pytest.fixture(autouse=True)
def _threads() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def _cluster_session() -> Iterator[None]:
    yield
    try:
        import ray
    except ImportError:
        return
    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def ray_cluster(_cluster_session: None) -> Any:
    """The ``ray`` module with a running local cluster (started on first use, kept for the session)."""
    ray = pytest.importorskip("ray", reason="needs Ray: pip install 'verl-core[ray]'")
    if not ray.is_initialized():
        start_cluster()
    return ray
