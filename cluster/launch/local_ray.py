"""The private local Ray of a run without --address: loopback only, torn down, never left behind.

- Everything listens on 127.0.0.1: Ray's own processes (its "not a cluster" mode, the
  dashboard on 127.0.0.1, on a free port rather than 8265, where `submit` looks for a
  cluster), gloo's sockets (GLOO_SOCKET_IFNAME / TP_SOCKET_IFNAME: the loopback
  interface) and torch's rendezvous store (`torch_store`), in the driver and every worker.
- Its sessions live in their own folder (`ray_root()`: TMPDIR/bertforge_ray_UID), never in
  /tmp/ray, so nothing here touches a Ray the user started with `ray start`.
- Each start records the driver (pid, start time) and the Ray processes it spawned in
  `ray_root()/drivers/`; the next start stops the processes of every recorded driver that is
  dead (a SIGKILLed run's raylet agents outlive it) and keeps only the newest `KEEP_SESSIONS`
  session folders that no live run uses. A live run's processes are never touched, nor those
  and the session of a record written in another container or on another node sharing TMPDIR
  (its host, pid namespace or boot id differ: its pids are not ours to judge).
- A start that times out (a cold or busy machine, or two Rays starting at once: the GCS port
  file, the GCS connection or the raylet's registration came too late) is retried, after
  stopping the processes the failed attempt left running; the GCS gets a longer port wait than
  Ray's 30 s default to begin with.
- Once it stops, the `pymp-*` folder its dashboard leaves in the temporary directory is
  removed (`multiprocessing_dirs`).
- `driver_teardown()` turns SIGTERM/SIGHUP/SIGINT into an exit (`StoppedBySignal`, 128 +
  signum), so `finally` blocks run (the run-directory lock is released) and Ray is shut down
  with its workers; a signal that is ignored (`nohup` ignores SIGHUP) or already handled is left
  as it is. `ray.init` replaces the SIGTERM handler (in the end with a C++ one that aborts):
  `reclaim_signals()` puts ours back after every start or connection.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator

from bertforge.cluster.launch import multiprocessing_dirs
from bertforge.cluster.safety.run_lock import process_scope
from bertforge.training.ports import free_loopback_port

KEEP_SESSIONS = 3
START_ATTEMPTS = 3
# Ray's messages for a start that was too slow or died young (ray/_private/node.py, services.py
# and the port wait in _raylet): the raylet never registered, the GCS never wrote its port file
# or never answered, the node's info never came, the dashboard died before it logged. Each is
# raised as a plain Exception/RuntimeError.
STARTUP_TIMEOUTS = (
    "timed out during startup",
    "Timed out waiting for file",
    "Failed to start GCS",
    "while waiting for node to startup",
    "Timed out waiting for node info",
    # The dashboard aborted (return code -6) before it wrote a line, while another Ray started
    # beside it on a loaded 2-core machine (CI, 2026-11-25); Ray then fails to read its logs.
    "Failed to read dashboard.err file",
    "Failed to start the dashboard",
)
# Seconds the GCS may take to write its port file (Ray's default: 30; 120 with RocksDB). A
# cold 2-core machine starting two Rays at once has missed 30; a user's setting is kept.
GCS_PORT_WAIT_S = "90"
# Two processes a private local Ray does not need, each a Python start (~1 s of a core here)
# while the workers start: Ray's idle workers prestarted for tasks (Ray Train runs actors), and
# Ray Train's preemption watcher, which polls whether a node is being drained: this one node
# never is. Measured with `bertforge train` of 20 demo steps, 2 workers, on the 2-core AVX2
# EPYC: 42.8 s against 45.2 s (medians of 4 alternated runs). The raylet and Ray Train's
# controller inherit them from this process's environment; a user's own setting is kept.
#
# And Ray Train's controller polls its workers every 0.5 s, not 2: each step of a run (the
# worker group started, training finished, a worker died) waits for the next poll. Measured with
# `bertforge train` of 5 tiny steps, 2 workers, on 2 Zen 4 cores: 20.8 s against 24.7 (medians
# of 4 alternated runs; 1 s gave ~23.9). A poll is one small actor call that a worker serves
# beside its training thread.
LOCAL_RAY_SETTINGS = {
    "RAY_prestart_worker_first_driver": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}
_RECORD = None  # this driver's record file, once it started a local Ray
# The temporary directory's multiprocessing folders before this driver's Ray started: those
# that appear later and are dead once it stopped are its dashboard's (multiprocessing_dirs).
_MULTIPROCESSING_DIRS_BEFORE: set[str] | None = None


def ray_root() -> str:
    # Short: Ray's unix socket paths live under it and are limited to 107 characters.
    return os.path.join(tempfile.gettempdir(), f"bertforge_ray_{os.getuid()}")


def _loopback_interface() -> str:
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addresses):
            return name
    return "lo"


def bind_to_loopback() -> None:
    """Make a local Ray and its workers listen on 127.0.0.1 only, not on the machine's address.

    Ray maps 127.0.0.1 to the routable address unless it believes it is not a cluster (its
    macOS/Windows mode); we set that mode in this process and, through the environment, in
    the GCS, raylet and worker processes it starts, which also inherit gloo's interface.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    interface = _loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    os.environ["TP_SOCKET_IFNAME"] = interface


def start(num_cpus: int) -> None:
    """Clean up after dead runs, then start this driver's private Ray on 127.0.0.1."""
    import ray

    root = ray_root()
    reap_dead_runs(root)
    bind_to_loopback()
    # A local run never joins the user's cluster: "local" starts a new instance whatever
    # RAY_ADDRESS says, and without these variables Ray's state API (which Ray Train's
    # controller polls) and the workers do not look for that cluster either.
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        os.environ.pop(name, None)
    os.environ.setdefault("RAY_gcs_server_port_wait_time_s", GCS_PORT_WAIT_S)
    for name, value in LOCAL_RAY_SETTINGS.items():
        os.environ.setdefault(name, value)
    global _MULTIPROCESSING_DIRS_BEFORE
    _MULTIPROCESSING_DIRS_BEFORE = multiprocessing_dirs.present()
    for attempt in range(1, START_ATTEMPTS + 1):
        before = _own_children()
        try:
            ray.init(
                address="local",
                num_cpus=num_cpus,
                # Ray Train's controller polls the state API, which the dashboard serves.
                include_dashboard=True,
                dashboard_host="127.0.0.1",
                # Not Ray's 8265: that is where `bertforge submit` and `ray job submit` look
                # for a cluster's tunnelled dashboard, and a job sent while this run trained
                # would run inside this throw-away Ray instead of failing to connect.
                dashboard_port=free_loopback_port(),
                configure_logging=False,
                _temp_dir=root,
            )
            reclaim_signals()
            break
        except Exception as error:  # Ray raises a bare Exception for some of these
            refuse_a_full_root(root, error)
            timeout = startup_timeout(error)
            if timeout is None or attempt == START_ATTEMPTS:
                raise
            # Ray gives its raylet a fixed 30 s to register; a cold machine starting two Rays at
            # once can miss it. The failed attempt's GCS and raylet keep running: stop them,
            # then start afresh (imports and disk caches are warm now).
            _stop(_own_children() - before)
            print(f"bertforge: the local Ray's start timed out ({timeout!r}); starting it "
                  f"again (attempt {attempt + 1} of {START_ATTEMPTS})", file=sys.stderr,
                  flush=True)
    _record_this_driver(root)


# Less free than this where Ray keeps its session after a failed start: the disk is why. Ray
# says nothing of it: its dashboard fails to start and Ray raises that log's last lines.
FULL_BELOW_BYTES = 16 * 2**20


def refuse_a_full_root(root: str, error: BaseException) -> None:
    """A start that failed on a full disk (TMPDIR's) said so in no word (a traceback of the
    dashboard's), and was retried into the same wall: one line naming the folder, at once."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return
    if free < FULL_BELOW_BYTES:
        raise OSError(errno.ENOSPC, f"no space left on the disk of {root}, where the local Ray "
                      f"keeps its session ({free / 2**20:.1f} MiB free): free space there, or "
                      "set TMPDIR to a folder with room, and run the same command again"
                      ) from error


def startup_timeout(error: BaseException) -> str | None:
    """Which of Ray's start-up timeouts `error` is, or None for any other failure."""
    message = str(error)
    return next((timeout for timeout in STARTUP_TIMEOUTS if timeout in message), None)


def _own_children() -> set:
    import psutil

    return set(psutil.Process().children(recursive=True))


def _stop(processes) -> None:
    import psutil

    processes = list(processes)
    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=5)
    for process in alive:  # the GCS server ignores SIGTERM
        with contextlib.suppress(psutil.Error):
            process.kill()


def _await_exit(processes, timeout_s: float = 10.0) -> None:
    """Wait for processes that are on their way out; kill those still running at `timeout_s`.

    No signal first: they are exiting already (a worker notices that its raylet is gone within
    0.9-1.3 s on the 2-core AVX2 EPYC). Not `psutil.wait_procs`: it also waits for exited
    processes left as zombies, which write nothing (the wait took 2.7-2.8 s there with it,
    after a SIGTERM to each, and 1.3-1.5 s with this loop).
    """
    import psutil

    deadline = time.monotonic() + timeout_s
    alive = [p for p in processes if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if running(p)]
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()


def running(process) -> bool:
    """Whether a psutil process still runs: an exited one left a zombie does not."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _process_key(process) -> dict:
    return {"pid": process.pid, "started": process.create_time()}


def _same_process(key: dict):
    """The live process `key` names, or None (gone, or the pid reused by another process)."""
    import psutil

    try:
        process = psutil.Process(key["pid"])
        if abs(process.create_time() - key["started"]) < 1.0:
            return process
    except psutil.Error:
        pass
    return None


def _started_processes() -> list:
    """What ray.init started here (GCS, raylet, dashboard, log monitor) and their children now
    (the raylet's agents and workers): never another child of this process."""
    import psutil
    import ray

    started = []
    for infos in ray._private.worker._global_node.all_processes.values():
        for info in infos:
            with contextlib.suppress(psutil.Error):
                process = psutil.Process(info.process.pid)
                started += [process] + process.children(recursive=True)
    return started


def _record_this_driver(root: str) -> None:
    import psutil
    import ray

    global _RECORD
    me = psutil.Process()
    node = ray._private.worker._global_node
    record = {
        "scope": process_scope(),
        "driver": _process_key(me),
        "session_dir": node.get_session_dir_path(),
        "processes": [_process_key(p) for p in _started_processes()],
    }
    os.makedirs(os.path.join(root, "drivers"), exist_ok=True)
    # Not the pid alone: drivers in two containers sharing TMPDIR can have the same pid.
    _RECORD = os.path.join(root, "drivers", f"{me.pid}_{uuid.uuid4().hex[:8]}.json")
    with open(_RECORD, "w", encoding="utf-8") as f:
        json.dump(record, f)


def _read_records(root: str) -> list[tuple[str, dict]]:
    folder = os.path.join(root, "drivers")
    records = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as f:
                records.append((path, json.load(f)))
        except (OSError, ValueError):
            continue
    return records


def reap_dead_runs(root: str | None = None, keep_sessions: int = KEEP_SESSIONS) -> list[int]:
    """Stop the Ray processes of recorded drivers that died; bound the session folders.

    Returns the pids stopped. Only processes a bertforge driver recorded as its own children are
    ever signalled, and only once that driver is gone.
    """
    root = root or ray_root()
    live_sessions, orphans = set(), []
    here = process_scope()
    for path, record in _read_records(root):
        # Another container's or node's run (records before scopes: judged as ours).
        if record.get("scope", here) != here or _same_process(record["driver"]) is not None:
            live_sessions.add(record["session_dir"])
            continue
        orphans += [p for p in map(_same_process, record["processes"]) if p is not None]
        with contextlib.suppress(OSError):
            os.remove(path)
    _stop(orphans)
    prune_sessions(root, keep_sessions, live_sessions)
    return [p.pid for p in orphans]


def prune_sessions(root: str, keep: int, live: set[str]) -> None:
    """Delete all but the newest `keep` session folders, never one a live run uses."""
    if not os.path.isdir(root):
        return
    # session_YYYY-MM-DD_HH-MM-SS_...: the names sort by start time.
    sessions = sorted((os.path.join(root, name) for name in os.listdir(root)
                       if name.startswith("session_2")), reverse=True)
    for path in sessions[keep:]:
        if path not in live:
            shutil.rmtree(path, ignore_errors=True)


def shutdown() -> None:
    """Stop this driver's Ray (if any) and forget its record.

    A local Ray is stopped with its workers: `ray.shutdown()` returns once the raylet is gone,
    while its workers notice that only later and go on meanwhile (a training worker can commit
    one more checkpoint). So the processes it started are waited for (and stopped if need be):
    once this returns, nothing of the run writes any more.
    """
    global _RECORD, _MULTIPROCESSING_DIRS_BEFORE
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            started = _started_processes() if _RECORD is not None else []
            ray.shutdown()
            _await_exit(started)
    if _MULTIPROCESSING_DIRS_BEFORE is not None:
        multiprocessing_dirs.remove_dead(since=_MULTIPROCESSING_DIRS_BEFORE)
        _MULTIPROCESSING_DIRS_BEFORE = None
    if _RECORD is not None:
        with contextlib.suppress(OSError):
            os.remove(_RECORD)
        _RECORD = None
        reap_dead_runs()  # and bound the session folders, ours now among them


class StoppedBySignal(SystemExit):
    """SIGTERM/SIGHUP/SIGINT turned into an exit: `finally` blocks run (locks released, Ray
    stopped with its workers), then the command says so in one line and exits 128 + signum."""

    def __init__(self, signum: int, note: str = "") -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.note = note  # what the command adds to its one line (e.g. the newest checkpoint)

    def describe(self) -> str:
        name = signal.Signals(self.signum).name
        return f"stopped by {name}" + (f"; {self.note}" if self.note else "")


_HANDLED: tuple[int, ...] = ()  # the signals driver_teardown turned into StoppedBySignal
_RECEIVED: list[int] = []  # the signals received since, first first


_ON_STOP: list = []  # what must happen before the stop can unwind (see `on_stop`)
# The command's work is done and only its shutdown (Ray's, 4-8 s) is left: a stop then ends
# nothing, and the command keeps its own exit status. (A SIGTERM from a scheduler's timeout in
# those seconds said "stopped by SIGTERM" and exited 143 after a finished run's summary.)
_WORK_DONE = False


def _exit_on_signal(signum, frame) -> None:
    _RECEIVED.append(signum)
    if _WORK_DONE and len(_RECEIVED) <= 2:
        return
    if len(_RECEIVED) > 1:
        # A stop is under way (workers stopping, Ray shutting down, the lock being released):
        # a second Ctrl-C must not cut it short. A third ends the process at once.
        if len(_RECEIVED) > 2:
            os._exit(128 + signum)
        return
    for callback in list(_ON_STOP):
        with contextlib.suppress(Exception):
            callback()
    raise StoppedBySignal(signum)


@contextlib.contextmanager
def on_stop(callback) -> Iterator[None]:
    """Within: a stop signal calls `callback()` before it raises. For engines whose cleanup
    waits on something the stop must end first: Beam's local runner joins its worker processes,
    which finish their bundle before they look at the closed control channel (minutes)."""
    _ON_STOP.append(callback)
    try:
        yield
    finally:
        _ON_STOP.remove(callback)


def as_stop(exit_: SystemExit) -> StoppedBySignal | None:
    """The stop a signal asked for, however it surfaced, or None for any other exit.

    Our exception does not always arrive as raised: a signal that lands while Ray waits in its
    C++ core worker (`ray.get`) comes out as Ray's own SystemExit(1), and one during `ray.init`,
    before `reclaim_signals`, as Ray's handler's SystemExit(15).
    """
    if isinstance(exit_, StoppedBySignal):
        return exit_
    if _RECEIVED:
        return StoppedBySignal(_RECEIVED[0])
    if exit_.code == signal.SIGTERM:
        return StoppedBySignal(signal.SIGTERM)
    return None


def reclaim_signals() -> None:
    """Put our handlers back after `ray.init`, which replaces them: first with its own Python
    SIGTERM handler (sys.exit(15)), then with its core worker's C++ one, which prints a stack
    dump and aborts the process (rc 134) without running a single `finally`."""
    with contextlib.suppress(ValueError):  # not the main thread
        for signum in _HANDLED:
            signal.signal(signum, _exit_on_signal)


@contextlib.contextmanager
def driver_teardown() -> Iterator[None]:
    """Around a command that may start Ray: SIGTERM/SIGHUP exit like Ctrl-C, Ray stops after."""
    global _HANDLED, _WORK_DONE
    installed = {}
    with contextlib.suppress(ValueError):  # not the main thread: leave the handlers alone
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            # Only where the default is in place (death; Python's KeyboardInterrupt for
            # SIGINT): `nohup` sets SIGHUP to SIG_IGN and a caller may have its own handler;
            # replacing those would kill a nohup'd run.
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                installed[signum] = signal.signal(signum, _exit_on_signal)
    _HANDLED = tuple(installed)
    _RECEIVED.clear()
    _WORK_DONE = False
    try:
        yield
        _WORK_DONE = True
    finally:
        _HANDLED = ()
        shutdown()
        _WORK_DONE = False
        for signum, previous in installed.items():
            signal.signal(signum, previous)
