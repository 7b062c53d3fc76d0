"""One CPU worker on this machine, in a child process of its own, without Ray: fine-tuning's
local default (`bertforge finetune`, `glue`, the demo's SST-2 stage).

Why not Ray Train for it: a local Ray's own processes (GCS, raylet, dashboard and its agent,
Ray Train's controller and helper actors) wake every few milliseconds and, on a 2-core machine,
preempt one of the worker's two torch threads: every parallel region then waits for it. Measured
by benchmarks/finetune_vs_plain_loop.py on a 2-core AMD EPYC (AVX2 only), BERT-base at 128
tokens, 2 threads: the same `training.finetune.loop.finetune` took 5.67-5.74 s/step in a plain
process against 6.70-7.29 s/step in a Ray Train worker, and a plain `transformers` loop
6.1-6.8 s/step, slower by ~10 % with an idle local Ray beside it. One worker needs no process
group across processes, so Ray brings it nothing but that cost and its start (7-8 s for a
local Ray alone on that machine, then Ray Train's controller and worker actors).

What Ray Train gave the worker, this gives it too:
- a 1-rank torch process group (gloo on 127.0.0.1: `training.engine.ensure_process_group`,
  which the worker function calls), its own: the driver's launcher variables (RANK,
  MASTER_PORT, ...) are not passed on;
- its torch threads (`OMP_NUM_THREADS` as Ray sets it, and the worker's own set_num_threads);
- its output: the child's stdout and stderr are relayed line by line through the driver's, so
  the console shows what the worker's `quiet_worker` lets through, when it happens, and the
  driver's log gets it too;
- restarts: a child that dies (a crash, the OOM killer) is started again, up to
  `launch.max_failures` times, and skips the work it finished (the worker function's own rule);
  past them the command ends with one line (`RestartsUsedUp`), as Ray Train's runs do;
  a `UserInputError` in the worker ends the command at once, with the worker's message;
- teardown: the driver's SIGTERM or Ctrl-C ends the child first; if the driver is killed
  outright, the kernel ends the child (PR_SET_PDEATHSIG).

The worker function is named by module and name (it must be importable, as for Ray) and takes
the worker config (a JSON-able dict), as `ray_train.run_on_ray`'s does.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from bertforge.cluster.launch.parent_death import die_with_parent
from bertforge.cluster.launch.worker_output import is_verbose
from bertforge.pipelines.contract.durable_files import write_json_atomic
from bertforge.training.errors import RestartsUsedUp, UserInputError
from bertforge.training.metrics import counted

if TYPE_CHECKING:  # the child imports this module: no Ray in it unless its function needs it
    from bertforge.cluster.launch.launch_config import LaunchConfig

# The child's exit status for a UserInputError (its message in the error file): not retried.
USER_ERROR_EXIT = 3
SPEC_NAME = "local-worker.json"
ERROR_NAME = "local-worker.error"
# A launcher's description of a process group (torchrun's, the deepspeed launcher's, or the
# 1-rank group `training.engine.ensure_process_group` makes in a plain process and records in
# its environment). The worker makes its own 1-rank group; inheriting these, it joined the
# driver's instead and failed on its port (a `finetune` run from a process that had trained).
LAUNCHER_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
})


def runs_in_one_local_process(launch: LaunchConfig) -> bool:
    """One CPU worker on this machine: no cluster (--address), no GPU, --workers 1."""
    return launch.workers == 1 and not launch.gpu and not launch.address


def run_in_local_process(worker_fn: Callable[[dict[str, Any]], None],
                         worker_config: dict[str, Any], launch: LaunchConfig,
                         state_dir: str) -> None:
    """`worker_fn(worker_config)` in one child process with `launch.cpus_per_worker` threads;
    its spec and error file live in `state_dir`. Raises UserInputError for the worker's user
    error, RestartsUsedUp (without a cause: nothing to report but its line) once it has failed
    `launch.max_failures` + 1 times."""
    os.makedirs(state_dir, exist_ok=True)
    spec_path = os.path.join(state_dir, SPEC_NAME)
    error_path = os.path.join(state_dir, ERROR_NAME)
    write_json_atomic(spec_path, {
        "function": f"{worker_fn.__module__}:{worker_fn.__qualname__}",
        "config": {**worker_config, "verbose": is_verbose()},
        "error_file": error_path,
    })
    threads = str(launch.cpus_per_worker)
    env = {name: value for name, value in os.environ.items() if name not in LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads)
    attempts = launch.max_failures + 1
    for attempt in range(1, attempts + 1):
        with contextlib.suppress(FileNotFoundError):
            os.remove(error_path)
        status = _run_child(spec_path, env)
        if status == 0:
            return
        if status == USER_ERROR_EXIT and os.path.exists(error_path):
            with open(error_path, encoding="utf-8") as f:
                raise UserInputError(f.read().strip())
        how = (f"killed by {signal.Signals(-status).name}" if status < 0
               else f"exit status {status}")
        if attempt == attempts:
            # One line, no traceback: the worker's own output, its crash's report among it,
            # came through the driver's already, and the driver's frames say nothing more.
            raise RestartsUsedUp(
                f"the local worker failed {counted(attempts, 'time')}, more than "
                f"--max-failures {launch.max_failures} allows (the last: {how}; its output is "
                f"above, its log in {worker_config.get('logs', state_dir)})")
        print(f"bertforge: the local worker stopped ({how}); starting it again (attempt "
              f"{attempt + 1} of {attempts})", file=sys.stderr, flush=True)


def _run_child(spec_path: str, env: dict[str, str]) -> int:
    """The child's exit status (negative: the signal that ended it), its lines relayed."""
    child = subprocess.Popen(
        [sys.executable, "-m", __name__, spec_path], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
    )
    relays = [threading.Thread(target=_relay, args=(stream, target), daemon=True)
              for stream, target in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    for relay in relays:
        relay.start()
    try:
        status = child.wait()
    finally:
        if child.poll() is None:  # the driver is stopping (SIGTERM, Ctrl-C): the child first
            child.terminate()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        for relay in relays:
            relay.join(timeout=10)
    return status


def _relay(stream, target) -> None:
    """The child's lines through the driver's stream (its console filter and its log)."""
    for line in stream:
        target.write(line)
        target.flush()


# --- the child ---------------------------------------------------------------------------------


_STOPS: list[int] = []  # the stop signals this child received
_holding = False  # within `stops_held`


def _stop(signum: int, frame) -> None:
    # A second stop (the driver's SIGTERM after Ctrl-C reached the whole group) finds the
    # child exiting already, often waiting for its threads at the interpreter's shutdown:
    # raised there, its SystemExit was printed as "Exception ignored in: <module 'threading'>"
    # with a traceback. Recorded only; a first exit lost in a finalizer `stop_if_asked` raises
    # again, and the driver kills a child still there after 10 s.
    first = not _STOPS
    _STOPS.append(signum)
    if first and not _holding:
        sys.exit(128 + signum)


def stop_if_asked() -> None:
    """Exit as a stop signal asked, if one came. The signal's own exit is lost where it lands
    in a finalizer (the garbage collection after a fine-tuning run: "Exception ignored in ...
    SystemExit"), and the child trained on until the driver killed it; a worker calls this
    between units of work. Nothing to do outside the local worker process."""
    if _STOPS:
        sys.exit(128 + _STOPS[0])


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """A stop (SIGINT, SIGTERM) that comes within the block exits when it ends: one that
    lands in a finalizer (garbage collection) is lost there, printed as "Exception ignored in
    ..."; held, its exit unwinds from here. (Masking the signal would not do: a thread that
    does not mask it takes it, and Python runs the handler in the main thread all the same.)"""
    global _holding
    _holding = True
    try:
        yield
    finally:
        _holding = False
    stop_if_asked()


def main(argv: list[str]) -> int:
    die_with_parent()  # the driver, however it dies
    # This file runs as __main__; the worker function imports it again under its own name, and
    # that module's `stops_held` and `stop_if_asked` must see the stops: its handler, then.
    from bertforge.cluster.launch import local_worker

    signal.signal(signal.SIGTERM, local_worker._stop)
    # Ctrl-C reaches the whole process group; where the driver ignores it (a script's `&`),
    # so does this child (driver_teardown's rule).
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, local_worker._stop)
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    module, name = spec["function"].split(":")
    worker_fn = getattr(importlib.import_module(module), name)
    # The function sets up its output first, then joins the process group Ray Train would have
    # made (`training.engine.ensure_process_group` makes a 1-rank one): importing DeepSpeed
    # here would log before the worker's output is routed.
    try:
        worker_fn(spec["config"])
    except UserInputError as error:
        with open(spec["error_file"], "w", encoding="utf-8") as f:
            f.write(str(error))
        return USER_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
