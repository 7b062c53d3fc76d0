"""Real Ray clusters on 127.0.0.1 (`ray start`), private to the tests that ask for them."""

from __future__ import annotations

import os
import time

import pytest

from tests.support.local_cluster import LocalRayCluster

# Ray Train's controller looks at its workers every 2 s by default: each run's end and each
# worker's death were noticed up to 2 s late. Inherited by the controller, the `bertforge`
# subprocesses and the `ray start` nodes (hence their jobs).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="module")
def two_node_cluster():
    """A head and a second node with one CPU each: one training worker fits on each. Yielded
    once its jobs endpoint answers."""
    with LocalRayCluster(multi_node=True) as cluster:
        cluster.start_head(num_cpus=1)
        cluster.add_node(num_cpus=1)
        _wait_for_jobs_endpoint(cluster.dashboard_url)
        yield cluster


def _wait_for_jobs_endpoint(url: str, timeout_s: float = 60.0) -> None:
    from bertforge.cluster.launch.submit import jobs_client

    deadline = time.time() + timeout_s
    while True:
        try:
            jobs_client(url).list_jobs()
            return
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(1.0)
