"""Worker functions for `cluster.launch.local_worker`'s tests: importable by name in the child."""

from __future__ import annotations

import os

from bertforge.training.errors import UserInputError


def refuse_the_inputs(config: dict) -> None:
    raise UserInputError(f"no such column {config['column']!r} in the data")


def crash_once_then_finish(config: dict) -> None:
    """The first attempt dies as a crash does (no cleanup); the second writes its result."""
    marker = os.path.join(config["dir"], "attempted")
    if not os.path.exists(marker):
        open(marker, "w").close()
        print("working", flush=True)
        os._exit(9)
    with open(os.path.join(config["dir"], "done"), "w", encoding="utf-8") as f:
        f.write(f"{os.environ['OMP_NUM_THREADS']} {os.getppid()}")
    print("[finetune] the worker's own line", flush=True)


def always_crash(config: dict) -> None:
    """A worker that dies on every attempt with a crash's report of its own (a bug, a lost
    device): exit status 1 after its traceback."""
    print("[finetune] working", flush=True)
    raise RuntimeError("the worker's own crash")


def join_a_process_group(config: dict) -> None:
    """What a fine-tuning worker does first: its 1-rank group (training.engine)."""
    import torch.distributed as dist

    from bertforge.training.engine import ensure_process_group

    ensure_process_group()
    with open(os.path.join(config["dir"], "group"), "w", encoding="utf-8") as f:
        f.write(f"{dist.get_rank()} {dist.get_world_size()}")


def stop_inside_a_hold(config: dict) -> None:
    """A SIGTERM inside `stops_held` (a run's garbage collection): the child exits as the hold
    ends, not inside it, and not never."""
    import signal
    import time

    from bertforge.cluster.launch.local_worker import stops_held

    with stops_held():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        open(os.path.join(config["dir"], "held"), "w").close()
    open(os.path.join(config["dir"], "after"), "w").close()


def stopped_twice(config: dict) -> None:
    """Ctrl-C, then the driver's SIGTERM while the child is already exiting (waiting for a
    thread at the interpreter's shutdown): the second stop printed "Exception ignored in:
    <module 'threading'> ... SystemExit: 143" onto the console."""
    import signal
    import threading
    import time

    def terminate_during_shutdown() -> None:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)

    threading.Thread(target=terminate_during_shutdown).start()  # not a daemon: waited for
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
    open(os.path.join(config["dir"], "after"), "w").close()
