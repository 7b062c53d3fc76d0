"""The test clusters' stop (tests/support/local_cluster.py) ends every process the cluster
started, and no other: `ray stop` is never an option on a shared machine."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import psutil

from tests.support.local_cluster import LocalRayCluster

# A stand-in for the raylet: its command line names the cluster's temp dir (argv[1]); the child
# it starts, like Ray's agents (`ray::DashboardAgent`), names none, and outlives its parent.
RAYLET = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(sys.argv[2], "w") as f:
    f.write(str(child.pid))
time.sleep(120)
"""


def test_stop_ends_the_processes_the_cluster_started_under_other_titles(tmp_path):
    cluster = LocalRayCluster()
    pid_file = tmp_path / "agent.pid"
    raylet = subprocess.Popen([sys.executable, "-c", RAYLET, cluster.temp_dir, str(pid_file)])
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    agent = None
    try:
        deadline = time.time() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.time() < deadline, "the stand-in raylet did not start its agent"
            time.sleep(0.05)
        agent = psutil.Process(int(pid_file.read_text()))
        cluster.stop()
        raylet.wait(timeout=10)
        # Before: the agent was left running, orphaned, after every stop.
        psutil.wait_procs([agent], timeout=10)
        assert not agent.is_running() or agent.status() == psutil.STATUS_ZOMBIE
        assert bystander.poll() is None  # a process the cluster did not start is left alone
    finally:
        for process in (raylet, bystander):
            process.kill()
            process.wait()
        if agent is not None:
            with contextlib.suppress(psutil.Error):
                agent.kill()
