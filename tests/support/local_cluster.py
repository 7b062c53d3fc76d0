"""A real multi-node Ray cluster on this machine (`ray start`), bound to 127.0.0.1.

For tests and benchmarks of what crosses nodes: a head plus any number of worker nodes, each
a separate raylet with its own ports, stopped without touching any other Ray on the machine.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import psutil

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def as_local_rank(rank: int, world_size: int, port: int) -> None:
    """Makes this spawned process rank `rank` of `world_size` on this machine, as a launcher
    would (RANK, WORLD_SIZE, MASTER_*: `training.engine.ensure_process_group` joins the group),
    on one thread: the ranks share the machine's cores."""
    import torch

    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)


class LocalRayCluster:
    """`with LocalRayCluster(multi_node=True) as c: c.start_head(1); c.add_node(1)`.

    Single-node mode binds everything to 127.0.0.1. Ray maps 127.0.0.1 to the machine's
    routable address whenever it may form a multi-node cluster, so multi-node mode gives each
    node its own other loopback address (127.0.0.2, 127.0.0.3, ...): all traffic stays on lo.
    """

    def __init__(self, *, multi_node: bool = False) -> None:
        self.multi_node = multi_node
        # Short: Ray's unix socket paths live under it and are limited to 107 characters.
        self.temp_dir = tempfile.mkdtemp(prefix="bfray_", dir="/tmp")
        self.node_ips: list[str] = []
        self.gcs_address: str | None = None
        self.dashboard_url: str | None = None
        self._ports_given: set[int] = set()

    @property
    def head_ip(self) -> str:
        return self.node_ips[0]

    def start_head(self, num_cpus: int) -> None:
        self._ensure_token()
        gcs_port, dashboard_port = self._free_port(), self._free_port()
        ip = self._next_ip()
        self._ray_start(
            ip, "--head", f"--port={gcs_port}", f"--num-cpus={num_cpus}",
            f"--dashboard-host={ip}", f"--dashboard-port={dashboard_port}",
            f"--temp-dir={self.temp_dir}", f"--ray-client-server-port={self._free_port()}",
        )
        self.gcs_address = f"{ip}:{gcs_port}"
        self.dashboard_url = f"http://{ip}:{dashboard_port}"

    def add_node(self, num_cpus: int) -> None:
        """Another raylet: Ray's own multi-node tests run several on one machine too."""
        if self.gcs_address is None or not self.multi_node:
            raise RuntimeError("add_node needs a head of LocalRayCluster(multi_node=True)")
        self._ray_start(self._next_ip(), f"--address={self.gcs_address}",
                        f"--num-cpus={num_cpus}", f"--node-manager-port={self._free_port()}",
                        f"--object-manager-port={self._free_port()}")

    def _ensure_token(self) -> None:
        """Nodes and clients authenticate with ~/.ray/auth_token; a fresh machine has none
        until something makes one (`ray.init` does; `ray start` does not)."""
        import fcntl

        from bertforge.cluster.launch.submit import cluster_token

        # Two test processes (pytest-xdist workers) starting clusters at once must not each
        # write a token of their own: one's nodes would then hold a token the file no longer has.
        os.makedirs(os.path.expanduser("~/.ray"), exist_ok=True)
        with open(os.path.expanduser("~/.ray/.bertforge-token.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if cluster_token() is None:
                subprocess.run([self._ray_cli(), "get-auth-token", "--generate"], check=True,
                               stdout=subprocess.DEVNULL, timeout=60)

    def _free_port(self) -> int:
        """A free port this cluster has not handed out yet: the ports of one `ray start` are
        chosen before any is bound, and the kernel gave one twice (a node failed to start
        with --dashboard-agent-grpc-port and --metrics-export-port both 53849)."""
        port = free_port()
        while port in self._ports_given:
            port = free_port()
        self._ports_given.add(port)
        return port

    @staticmethod
    def _ray_cli() -> str:
        return os.path.join(os.path.dirname(sys.executable), "ray")

    def _next_ip(self) -> str:
        ip = f"127.0.0.{len(self.node_ips) + 2}" if self.multi_node else LOOPBACK
        self.node_ips.append(ip)
        return ip

    def _ray_start(self, ip: str, *args: str) -> None:
        # Ray's agents default to fixed ports (52365, ...): a second Ray on this machine would
        # collide and its job agent die, so every node takes free ones.
        ports = [f"--{name}={self._free_port()}" for name in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
            "runtime-env-agent-port")]
        # "Not a cluster" keeps a single node on 127.0.0.1; Ray refuses extra nodes in it.
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1" if self.multi_node else "0",
               # Every node proves itself with the cluster's token (~/.ray/auth_token).
               "RAY_AUTH_MODE": "token",
               # Ray Train's controller polls every 0.5 s, as in a private local Ray
               # (local_ray.LOCAL_RAY_SETTINGS): each job's start and end wait ~4 s less.
               "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
               # Jobs run `python ...` / `bertforge ...` from the raylet's PATH: this
               # interpreter's environment, activated or not.
               "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}
        # The daemons inherit stdout/stderr: a pipe we stop reading would kill them (EPIPE).
        with open(os.path.join(self.temp_dir, "ray-start.log"), "a") as log:
            subprocess.run(
                [self._ray_cli(), "start",
                 f"--node-ip-address={ip}", "--disable-usage-stats", *args, *ports],
                check=True, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=120,
            )

    def stop(self) -> None:
        """Stop this cluster's processes only: `ray stop` would stop every Ray on the machine."""
        victims = self._processes()
        for process in victims:
            with contextlib.suppress(psutil.Error):
                process.terminate()
        # The GCS server ignores SIGTERM and the raylet and autoscaler monitor outlive it by
        # more than 15 s: a longer grace only made every stop wait (their workers exit when
        # the raylet is gone).
        _, alive = psutil.wait_procs(victims, timeout=2)
        for process in alive:
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(alive, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _processes(self) -> list[psutil.Process]:
        """Those naming our temp dir, and everything they started: the raylet's agents retitle
        themselves (`ray::DashboardAgent`, `ray::RuntimeEnvAgent`), so their command line names
        no temp dir, and they outlive a raylet that is killed (every stop left both running)."""
        found: dict[int, psutil.Process] = {}
        for process in psutil.process_iter(["cmdline"]):
            if self.temp_dir in " ".join(process.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    for member in (process, *process.children(recursive=True)):
                        found[member.pid] = member
        return list(found.values())

    def __enter__(self) -> LocalRayCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
