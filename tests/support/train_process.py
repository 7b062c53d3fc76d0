"""A real `bertforge train` in a subprocess with a private temp dir (so its local Ray's session
folders are its own), and what its process tree is doing: for the lock, socket and exit tests."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import psutil

from bertforge.cluster.launch.local_ray import running

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def train_command(data_dir: str, run_dir: str, *, workers: int = 1,
                  max_steps: int = 100_000) -> list[str]:
    """A tiny fp32 run that goes on until stopped (a few steps a second on one core)."""
    return [os.path.join(os.path.dirname(sys.executable), "bertforge"), "train",
            "--data", data_dir, "--run-dir", run_dir, "--preset", "tiny", "--precision", "fp32",
            "--max-steps", str(max_steps), "--micro-batch-size", "2", "--workers", str(workers),
            "--max-failures", "0", "--log-every", "1"]


class TrainProcess:
    """`with TrainProcess(command) as run: run.wait_until_training()`; the temp dir (`ray_root`
    holds the run's Ray sessions) and any process left are removed on exit."""

    def __init__(self, command: list[str], cwd: str | None = None) -> None:
        # Short: Ray's unix socket paths live under it and are limited to 107 characters.
        self.tmpdir = tempfile.mkdtemp(prefix="bft", dir="/tmp")
        self.cwd = cwd
        self.run_dir = os.path.join(cwd or "", command[command.index("--run-dir") + 1])
        # The console, kept in files (a pipe nobody reads would fill and block the run).
        self.stdout_path = os.path.join(self.tmpdir, "stdout")
        self.stderr_path = os.path.join(self.tmpdir, "stderr")
        with open(self.stdout_path, "w") as stdout, open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(command, env=self.env, cwd=cwd, stdout=stdout,
                                            stderr=stderr, text=True,
                                            preexec_fn=sigint_as_in_a_terminal)
        self.seen: dict[int, psutil.Process] = {}

    @property
    def env(self) -> dict[str, str]:
        """The environment of the run (and of any command beside it: its Ray sessions here)."""
        return {**os.environ, "TMPDIR": self.tmpdir}

    def stderr(self) -> str:
        with open(self.stderr_path, encoding="utf-8") as f:
            return f.read()

    def stdout(self) -> str:
        with open(self.stdout_path, encoding="utf-8") as f:
            return f.read()

    @property
    def ray_root(self) -> str:
        return os.path.join(self.tmpdir, f"bertforge_ray_{os.getuid()}")

    def logged_steps(self) -> int:
        try:
            with open(os.path.join(self.run_dir, "metrics.jsonl"), encoding="utf-8") as f:
                return sum(1 for _ in f)
        except FileNotFoundError:
            return 0

    def wait_until_training(self, steps: int = 2, timeout_s: float = 300.0) -> None:
        """Until `steps` steps are logged (Ray's start takes minutes on a loaded 2-core box)."""
        deadline = time.time() + timeout_s
        while self.logged_steps() < steps:
            assert self.process.poll() is None, f"the run ended ({self.process.returncode})"
            assert time.time() < deadline, "the run did not start training"
            time.sleep(0.5)

    def wait_for(self, path: str, timeout_s: float = 300.0) -> None:
        """Until `path` exists (a checkpoint's commit marker, ...) while the run goes on."""
        deadline = time.time() + timeout_s
        while not os.path.exists(path):
            assert self.process.poll() is None, \
                f"the run ended ({self.process.returncode}): {self.stderr()[-2000:]}"
            assert time.time() < deadline, f"no {path} after {timeout_s:.0f} s"
            time.sleep(0.2)

    def tree(self) -> list[psutil.Process]:
        """The driver and its descendants now, also remembered for `survivors`."""
        driver = psutil.Process(self.process.pid)
        processes = [driver] + driver.children(recursive=True)
        self.seen.update((p.pid, p) for p in processes)
        return processes

    def survivors(self, timeout_s: float = 30.0) -> list[str]:
        """Processes ever seen in the tree that are still running after `timeout_s`."""
        deadline = time.time() + timeout_s
        while True:
            alive = [p for p in self.seen.values() if running(p)]
            if not alive or time.time() > deadline:
                return [f"{p.pid} {_name(p)}" for p in alive]
            time.sleep(0.5)

    def __enter__(self) -> TrainProcess:
        return self

    def __exit__(self, *exc_info) -> None:
        with contextlib.suppress(psutil.Error):
            self.tree()
        for process in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if running(process):
                    process.kill()
        self.process.wait(timeout=60)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def sigint_as_in_a_terminal() -> None:
    """SIGINT's default, whatever the test runner set (one that ignores it would pass the
    ignoring on, and Ctrl-C would do nothing to the run)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def listening_sockets(processes: list[psutil.Process]) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP and bound UDP socket."""
    found = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            for conn in process.net_connections(kind="inet"):
                is_tcp_listen = conn.status == psutil.CONN_LISTEN
                is_udp_bound = conn.status == psutil.CONN_NONE and not conn.raddr
                if is_tcp_listen or is_udp_bound:
                    found.append((_name(process), conn.laddr.ip, conn.laddr.port))
    return found


def _name(process: psutil.Process) -> str:
    try:
        return f"{process.name()} {' '.join(process.cmdline())[:50]}"
    except psutil.Error:
        return "?"
