"""A real Ray head on 127.0.0.1 (`ray start --head`), private to the test that asks for it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import psutil
import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def _private_ports() -> list[str]:
    """Ray's agents default to fixed ports (52365, ...): a second Ray on the machine would
    collide and its job agent die, so this head takes free ones."""
    names = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
             "runtime-env-agent-port", "ray-client-server-port")
    return [f"--{name}={free_port()}" for name in names]


def _stop_cluster(temp_dir: str) -> None:
    """Stop only this cluster's processes: `ray stop` would stop every Ray on the machine."""
    victims = [p for p in psutil.process_iter(["cmdline"])
               if temp_dir in " ".join(p.info["cmdline"] or [])]
    for process in victims:
        process.terminate()
    _, alive = psutil.wait_procs(victims, timeout=10)
    for process in alive:
        process.kill()


@pytest.fixture(scope="module")
def ray_head():
    """Yields (dashboard_url, gcs_address) of a fresh head bound to the loopback address."""
    temp_dir = tempfile.mkdtemp(prefix="bfray_", dir="/tmp")  # short: Ray's socket paths
    gcs_port, dashboard_port = free_port(), free_port()
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # keep Ray on loopback
    # The daemons inherit stdout/stderr: a pipe we stop reading would kill them (EPIPE).
    with open(os.path.join(temp_dir, "ray-start.log"), "w") as log:
        subprocess.run(
            [_ray_cli(), "start", "--head", "--node-ip-address=127.0.0.1",
             f"--port={gcs_port}", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dashboard_port}", "--num-cpus=2", f"--temp-dir={temp_dir}",
             "--disable-usage-stats", *_private_ports()],
            check=True, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=120,
        )
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        _wait_for_jobs_endpoint(url)
        yield url, f"127.0.0.1:{gcs_port}"
    finally:
        _stop_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_for_jobs_endpoint(url: str, timeout_s: float = 60.0) -> None:
    from cluster.submit import jobs_client

    deadline = time.time() + timeout_s
    while True:
        try:
            jobs_client(url).list_jobs()
            return
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(1.0)
