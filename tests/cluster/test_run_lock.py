"""One run per run directory: the lock file (cluster/safety/run_lock.py). Two real `bertforge train`
runs on one run directory are in test_train_from_outside.py (one Ray start serves its checks)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
from pyarrow import fs

from bertforge.cluster.safety.run_lock import (
    LOCK_NAME,
    Holder,
    RunDirectoryInUse,
    RunLock,
    _StorageFile,
    exclusive_directory,
)


def lock_record(path) -> dict:
    return json.loads((path / LOCK_NAME).read_text())


def write_lock(path, **changes) -> None:
    record = {**json.loads(Holder.me("train").dumps()), **changes}
    path.mkdir(parents=True, exist_ok=True)
    (path / LOCK_NAME).write_text(json.dumps(record))


def dead_pid() -> tuple[int, float]:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(process.pid).create_time()
    process.wait()
    return process.pid, started


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_goes_with_the_first(tmp_path):
    with exclusive_directory(str(tmp_path), "train"):
        record = lock_record(tmp_path)
        assert (record["host"], record["pid"]) == (socket.gethostname(), os.getpid())
        with pytest.raises(RunDirectoryInUse) as refused:
            with exclusive_directory(str(tmp_path), "train"):
                pass
        message = str(refused.value)
        assert f"another bertforge train is running in {tmp_path}" in message
        assert f"host {socket.gethostname()}, pid {os.getpid()}, since 20" in message
        assert (tmp_path / LOCK_NAME).exists()  # the refused run left the holder's file alone
    assert not (tmp_path / LOCK_NAME).exists()
    with pytest.raises(KeyError):  # released on an error too
        with exclusive_directory(str(tmp_path), "train"):
            raise KeyError("boom")
    assert sorted(os.listdir(tmp_path)) == []


def test_a_dead_holder_is_taken_over_with_a_message(tmp_path, capsys):
    pid, started = dead_pid()
    write_lock(tmp_path, pid=pid, pid_start=started, heartbeat=time.time() - 3600,
               started=time.time() - 3600)
    with exclusive_directory(str(tmp_path), "train"):
        assert lock_record(tmp_path)["pid"] == os.getpid()
    out = capsys.readouterr().out
    assert f"taking over the lock of a run that is gone (host {socket.gethostname()}, pid {pid}" \
        in out


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    # The pid is alive (this process) but was started at another time: not the holder.
    write_lock(tmp_path, pid_start=psutil.Process().create_time() - 1000)
    with exclusive_directory(str(tmp_path), "train"):
        pass


def test_another_host_holds_while_its_heartbeat_is_fresh(tmp_path, capsys):
    write_lock(tmp_path, host="node-7", pid=1, heartbeat=time.time() - 5)
    with pytest.raises(RunDirectoryInUse, match=r"host node-7, pid 1, since .* heartbeat 5 s ago"):
        with exclusive_directory(str(tmp_path), "train"):
            pass
    write_lock(tmp_path, host="node-7", pid=1, heartbeat=time.time() - 600)
    with exclusive_directory(str(tmp_path), "train"):
        assert lock_record(tmp_path)["host"] == socket.gethostname()
    assert "taking over the lock of a run that is gone (host node-7" in capsys.readouterr().out


def test_an_unreadable_lock_file_counts_as_held_until_stale_then_is_taken_over(tmp_path, capsys):
    (tmp_path / LOCK_NAME).write_text("")  # an older bertforge's flock file
    young = time.time() - 60
    os.utime(tmp_path / LOCK_NAME, (young, young))
    with pytest.raises(RunDirectoryInUse, match=r"cannot be read .* written 60 s ago"):
        with exclusive_directory(str(tmp_path), "pipeline"):
            pass
    old = time.time() - 200
    os.utime(tmp_path / LOCK_NAME, (old, old))
    with exclusive_directory(str(tmp_path), "pipeline"):
        assert lock_record(tmp_path)["command"] == "pipeline"
    assert "taking over an unreadable lock file (200 s old)" in capsys.readouterr().out


def test_a_newer_versions_lock_with_unknown_keys_is_still_held(tmp_path):
    write_lock(tmp_path, a_future_field={"x": 1})  # this process, alive
    with pytest.raises(RunDirectoryInUse, match="another bertforge train is running"):
        with exclusive_directory(str(tmp_path), "train"):
            pass


def test_a_dead_pid_of_another_boot_is_judged_by_its_heartbeat(tmp_path):
    # Same host name and (root) pid namespace, but another kernel: its pid means nothing here.
    pid, started = dead_pid()
    write_lock(tmp_path, pid=pid, pid_start=started, boot_id="another-node")
    with pytest.raises(RunDirectoryInUse, match=f"pid {pid}"):
        with exclusive_directory(str(tmp_path), "train"):
            pass
    write_lock(tmp_path, pid=pid, pid_start=started, boot_id="another-node",
               heartbeat=time.time() - 600)
    with exclusive_directory(str(tmp_path), "train"):
        assert lock_record(tmp_path)["pid"] == os.getpid()


def test_an_older_lock_without_boot_id_is_judged_by_its_heartbeat(tmp_path):
    pid, started = dead_pid()
    write_lock(tmp_path, pid=pid, pid_start=started)
    record = lock_record(tmp_path)
    del record["boot_id"]
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    with pytest.raises(RunDirectoryInUse, match=f"pid {pid}"):
        with exclusive_directory(str(tmp_path), "train"):
            pass


@pytest.mark.skipif(os.geteuid() == 0, reason="root may signal and inspect every process")
def test_a_process_of_another_user_counts_as_running(tmp_path):
    try:
        if psutil.Process(1).uids().real == os.geteuid():
            pytest.skip("pid 1 is this user's here")
        start = psutil.Process(1).create_time()
    except psutil.Error:  # a hidepid /proc: pid 1 cannot be seen, os.kill still finds it
        start = None
    write_lock(tmp_path, pid=1, pid_start=start)
    with pytest.raises(RunDirectoryInUse, match="pid 1,"):
        with exclusive_directory(str(tmp_path), "train"):
            pass


def test_the_heartbeat_is_refreshed_and_a_lost_lock_reported(tmp_path, capsys):
    with RunLock([str(tmp_path)], "train", heartbeat_seconds=0.05) as lock:
        first = lock_record(tmp_path)["heartbeat"]
        time.sleep(0.3)
        assert lock_record(tmp_path)["heartbeat"] > first
        # The next beat after our write, not during it: a beat seen after the change waits
        # 0.6 s before the next (a fixed sleep here lost that race on a loaded machine, and
        # the beat wrote over the other run's lock between its read and its write).
        lock.heartbeat_seconds = 0.6
        beat = lock_record(tmp_path)["heartbeat"]
        deadline = time.monotonic() + 10
        while lock_record(tmp_path)["heartbeat"] == beat and time.monotonic() < deadline:
            time.sleep(0.002)
        write_lock(tmp_path, host="node-9", token="someone else")
        time.sleep(1.0)
        assert lock_record(tmp_path)["host"] == "node-9"  # never overwritten once lost
        assert not lock._held
    assert "was taken by host node-9" in capsys.readouterr().out
    assert lock_record(tmp_path)["host"] == "node-9"  # and not removed on release


def test_two_runs_racing_for_one_directory_get_one_lock(tmp_path):
    outcomes: list[str] = []
    barrier = threading.Barrier(8)

    def contend() -> None:
        lock = RunLock([str(tmp_path)], "train")
        lock.me.token += str(threading.get_ident())  # eight holders in one process
        barrier.wait()
        try:
            lock.__enter__()
            outcomes.append("held")
        except RunDirectoryInUse:
            outcomes.append("refused")

    threads = [threading.Thread(target=contend) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["held"] + ["refused"] * 7


def test_a_lock_in_object_storage_is_written_read_back_and_refused_to_a_second_run(
        tmp_path, monkeypatch):
    monkeypatch.setattr("bertforge.cluster.safety.run_lock.SETTLE_SECONDS", 0.1)
    # A pyarrow filesystem as --storage sees one: a URI, no create-if-absent, no links.
    shared = fs.SubTreeFileSystem(str(tmp_path), fs.LocalFileSystem())

    def storage_lock():
        return _StorageFile("mock:///bucket/runs/r1", filesystem=shared)

    with RunLock([storage_lock()], "train"):
        assert json.loads((tmp_path / "bucket/runs/r1" / LOCK_NAME).read_text())["pid"] \
            == os.getpid()
        with pytest.raises(RunDirectoryInUse, match="running in mock:///bucket/runs/r1"):
            with RunLock([storage_lock()], "train"):
                pass
    assert not (tmp_path / "bucket/runs/r1" / LOCK_NAME).exists()
    pid, started = dead_pid()
    write_lock(tmp_path / "bucket/runs/r1", pid=pid, pid_start=started)
    with RunLock([storage_lock()], "train"):
        pass


def test_a_run_directory_that_cannot_hold_a_lock_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=f"cannot write the run lock in {tmp_path}/file/run"):
        with exclusive_directory(str(tmp_path / "file" / "run"), "train"):
            pass


# --- two real `bertforge train` runs -----------------------------------------------------


def test_a_directory_in_use_is_refused_without_taking_its_lock(tmp_path):
    """train's pre-flight says "another train is running" before it reads the run directory,
    whose checkpoints the other run is saving and pruning (a check read one being pruned)."""
    from bertforge.cluster.safety.run_lock import refuse_if_in_use

    run_dir = tmp_path / "run"
    refuse_if_in_use(str(run_dir))  # nobody: nothing said, nothing made
    assert not run_dir.exists()
    with exclusive_directory(str(run_dir), "train"):
        with pytest.raises(RunDirectoryInUse, match=f"another bertforge train is running in "
                                                    f"{run_dir} \\(host "):
            refuse_if_in_use(str(run_dir))
    refuse_if_in_use(str(run_dir))  # released
    (tmp_path / "a-file").write_text("not a directory")
    refuse_if_in_use(str(tmp_path / "a-file"))  # the pre-flight's own check names it


def test_a_worker_tells_the_drivers_run_directory_from_one_of_its_own(tmp_path):
    """Without --storage, a worker whose --run-dir is not the driver's (a node-local path)
    stops at once: the run used to train to the end and then find no complete checkpoint."""
    from bertforge.cluster.launch.ray_train import _refuse_a_run_dir_of_its_own
    from bertforge.cluster.safety.run_lock import held_with_token
    from bertforge.training.errors import UserInputError

    shared, own = tmp_path / "shared" / "run", tmp_path / "node-local" / "run"
    own.mkdir(parents=True)
    with exclusive_directory(str(shared), "train") as lock:
        token = lock.me.token
        assert held_with_token(str(shared), token)
        assert not held_with_token(str(shared), "another-drivers-token")
        assert not held_with_token(str(own), token)
        _refuse_a_run_dir_of_its_own(str(shared), token)  # the driver's own: passes
        with pytest.raises(UserInputError, match=r"--run-dir .*node-local/run on node .* is "
                           r"not the directory the driver locked: .*or add --storage"):
            _refuse_a_run_dir_of_its_own(str(own), token)


def test_a_file_where_the_directory_goes_is_named(tmp_path):
    """`demo --output afile` said only "cannot write the run lock in afile: File exists"."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder\n")
    for directory in (afile, afile / "sub"):
        with pytest.raises(ValueError, match=f"cannot write the run lock in {directory}: "
                                             f"{afile} is a file, not a directory"):
            with exclusive_directory(str(directory), "demo"):
                pass


def test_two_runs_taking_over_a_dead_holders_lock_without_hard_links_get_one_lock(
        tmp_path, monkeypatch):
    """On a mount without hard links (gcsfuse, some FUSE), two runs take over one dead holder's
    lock: the first publishes its own; the second, which read the dead holder's before that,
    moves the first's aside to check it, cannot link it back, and deleted it, then took the
    lock itself: two runs writing one directory. The first's lock must go back."""
    from bertforge.cluster.safety import run_lock

    def no_hard_links(*_):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(run_lock.os, "link", no_hard_links)
    pid, started = dead_pid()
    write_lock(tmp_path, pid=pid, pid_start=started, heartbeat=time.time() - 3600)
    dead = (tmp_path / LOCK_NAME).read_text()
    first = RunLock([str(tmp_path)], "train")
    first.me.token = "first"
    second = RunLock([str(tmp_path)], "train")
    read = run_lock._LocalFile.read
    reads = []

    def read_before_the_takeover(self):  # the second run read the dead holder's record first
        reads.append(1)
        return dead if len(reads) == 1 else read(self)

    with first:
        monkeypatch.setattr(run_lock._LocalFile, "read", read_before_the_takeover)
        with pytest.raises(RunDirectoryInUse, match="another bertforge train is running"):
            second.__enter__()
        assert lock_record(tmp_path)["token"] == "first"


def test_a_holder_that_died_unreaped_is_gone(tmp_path):
    """A holder killed (the OOM killer, kill -9) whose parent has not reaped it yet (a notebook
    or a script that started it and waits on something else) is a zombie: its pid still
    answers os.kill(pid, 0), and the directory stayed locked with nothing running in it."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(child.pid).create_time()
        write_lock(tmp_path, pid=child.pid, pid_start=started)
        os.kill(child.pid, 9)
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        with exclusive_directory(str(tmp_path), "train"):  # taken over, not refused
            assert lock_record(tmp_path)["pid"] == os.getpid()
    finally:
        child.kill()
        child.wait()


def test_a_run_that_read_a_dead_holders_lock_late_leaves_the_run_that_took_it_over_alone(
        tmp_path, monkeypatch):
    """Three runs start on a directory a dead run left locked. The first takes the lock over;
    the second read the dead holder's record before that and, checking it, moved the first's
    fresh lock aside; the third took the lock in that moment (a rename and a link take a round
    trip on NFS), the first's could not go back: two runs writing one directory."""
    from bertforge.cluster.safety import run_lock

    pid, started = dead_pid()
    write_lock(tmp_path, pid=pid, pid_start=started)
    dead = (tmp_path / LOCK_NAME).read_text()
    first = RunLock([str(tmp_path)], "train")
    first.me.token = "first"
    second = RunLock([str(tmp_path)], "train")
    third = RunLock([str(tmp_path)], "train")
    third.me.token = "third"
    read, rename = run_lock._LocalFile.read, os.rename
    reads, third_run = [], []

    def read_before_the_takeover(self):  # the second run read the dead holder's record first
        reads.append(1)
        return dead if len(reads) == 1 else read(self)

    def start_the_third_run() -> None:
        try:
            third.__enter__()
            third_run.append("held")
        except RunDirectoryInUse:
            third_run.append("refused")

    def the_third_run_starts_while_a_lock_is_aside(source, destination):
        rename(source, destination)
        if destination.endswith(".stale") and not third_run:
            start_the_third_run()

    with first:
        monkeypatch.setattr(run_lock._LocalFile, "read", read_before_the_takeover)
        monkeypatch.setattr(run_lock.os, "rename", the_third_run_starts_while_a_lock_is_aside)
        try:
            with pytest.raises(RunDirectoryInUse, match="another bertforge train is running"):
                second.__enter__()
            if not third_run:
                start_the_third_run()
            assert third_run == ["refused"]
            assert lock_record(tmp_path)["token"] == "first"
        finally:
            if third_run == ["held"]:
                third.__exit__(None, None, None)


def test_a_takeover_claim_left_by_a_run_that_died_does_not_keep_the_lock_forever(tmp_path):
    from bertforge.cluster.safety import run_lock

    pid, started = dead_pid()
    write_lock(tmp_path, pid=pid, pid_start=started)
    claim = run_lock._LocalFile(str(tmp_path))._claim_path((tmp_path / LOCK_NAME).read_text())
    claimant = {**json.loads(Holder.me("takeover").dumps()), "pid": pid, "pid_start": started}
    with open(claim, "w", encoding="utf-8") as f:
        f.write(json.dumps(claimant))
    with exclusive_directory(str(tmp_path), "train"):
        assert lock_record(tmp_path)["pid"] == os.getpid()
    assert sorted(os.listdir(tmp_path)) == []


def test_a_stalled_holders_heartbeat_does_not_write_over_the_run_that_took_it_over(
        tmp_path, capsys):
    """A holder on another node stalled past the staleness (a paused VM, SIGSTOP), and another
    run took its lock over just as its heartbeat, resumed, had read its own record and was
    about to write it again (seen with real processes where a write takes a round trip): the
    write landed over the new holder's lock, the stalled run went on as the holder, and the
    new one was told it lost the lock. Now the stalled run's next beat finds the lock lost."""
    from bertforge.cluster.safety import run_lock

    stalled = RunLock([str(tmp_path)], "train", heartbeat_seconds=3600)
    stalled.me.host, stalled.me.token = "another-node", "stalled"  # judged by its heartbeat
    taker = RunLock([str(tmp_path)], "train", stale_after_seconds=0.0)  # every beat is old
    taker.me.token = "taker"
    read = run_lock._LocalFile.read
    took_over = []

    def the_other_run_takes_over_after_the_beat_read(self):
        text = read(self)
        if not took_over:
            took_over.append(1)
            taker.__enter__()
        return text

    with stalled:
        run_lock._LocalFile.read = the_other_run_takes_over_after_the_beat_read
        try:
            stalled._refresh(stalled.files[0])
        finally:
            run_lock._LocalFile.read = read
        try:
            assert lock_record(tmp_path)["token"] == "taker"
            stalled._refresh(stalled.files[0])  # its next beat
            assert stalled._held == []
            assert "was taken by host" in capsys.readouterr().out
        finally:
            taker.__exit__(None, None, None)


def test_a_heartbeat_that_cannot_write_is_tried_again_at_the_next_beat(tmp_path, monkeypatch):
    """A full disk fails one beat's write: an OSError, which the heartbeat lets go and tries
    again (any other error ended its thread: no more beats, and after the staleness another
    node took the lock of a run still writing)."""
    from bertforge.cluster.safety import run_lock

    with RunLock([str(tmp_path)], "train", heartbeat_seconds=3600) as lock:
        write_private = run_lock._LocalFile._write_private

        def disk_full(self, text):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(run_lock._LocalFile, "_write_private", disk_full)
        with pytest.raises(OSError):
            lock._refresh(lock.files[0])
        monkeypatch.setattr(run_lock._LocalFile, "_write_private", write_private)
        lock.me.heartbeat = time.time() + 5
        lock._refresh(lock.files[0])
        assert lock_record(tmp_path)["heartbeat"] == lock.me.heartbeat
        assert lock._held == lock.files
