"""local_ray.start retries when Ray's start times out (any of the waits Ray can miss on a cold or
busy machine), after stopping what the failed attempt left running; any other failure of
ray.init is raised at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import ray
from ray._private import ray_constants

from bertforge.cluster.launch import local_ray

RAY_TIMEOUT = ("The current node timed out during startup. This could happen because some of "
               "the raylet failed to startup or the GCS has become overloaded.")
# What Ray 2.60 raised on a Zen 4 machine whose other xdist worker started a Ray at the same time.
GCS_PORT_TIMEOUT = ("Timed out waiting for file /tmp/bertforge_ray_0/session_2026-11-20_10-01-02"
                    "_123456_789/gcs_server_port_0123abcd (30000 ms).")


@pytest.fixture
def fake_start(monkeypatch, tmp_path):
    """start() with ray.init replaced by `outcomes`, one per call (an exception to raise, a
    function to call, or None for success), and nothing recorded."""
    for name in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "restored after the test")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    monkeypatch.setattr(local_ray, "ray_root", lambda: str(tmp_path))
    recorded = []
    monkeypatch.setattr(local_ray, "_record_this_driver", recorded.append)
    calls, outcomes = [], []

    def fake_init(**kwargs):
        calls.append(kwargs)
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        if outcome is not None:
            outcome()

    monkeypatch.setattr(ray, "init", fake_init)
    return outcomes, calls, recorded


@pytest.mark.parametrize("message", [RAY_TIMEOUT, GCS_PORT_TIMEOUT,
                                     "Failed to start GCS.  Last 0 lines of error files:",
                                     "Failed to read dashboard.err file: [Errno 2] No such "
                                     "file or directory: '/tmp/x/logs/dashboard.err'."])
def test_a_start_that_times_out_is_cleaned_up_and_retried(fake_start, capfd, message):
    outcomes, calls, recorded = fake_start
    left_over = []

    def start_something_then_time_out():  # as Ray does: its GCS runs on after the timeout
        left_over.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
        raise (Exception if message is RAY_TIMEOUT else RuntimeError)(message)

    outcomes += [start_something_then_time_out, None]
    try:
        local_ray.start(num_cpus=2)
        # Stopped (and reaped) before the retry, not left to run on: poll() is None while a
        # process runs.
        assert left_over[0].poll() is not None
    finally:
        left_over[0].kill()
    assert len(calls) == 2 and calls[1]["address"] == "local"
    assert len(recorded) == 1
    assert "starting it again" in capfd.readouterr().err


def test_the_gcs_gets_a_longer_port_wait_unless_the_user_set_one(fake_start, monkeypatch):
    outcomes, _, _ = fake_start
    monkeypatch.delenv("RAY_gcs_server_port_wait_time_s", raising=False)
    outcomes += [None]
    local_ray.start(num_cpus=2)
    assert int(os.environ["RAY_gcs_server_port_wait_time_s"]) > 30  # Ray's default
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "7")
    outcomes += [None]
    local_ray.start(num_cpus=2)
    assert os.environ["RAY_gcs_server_port_wait_time_s"] == "7"


def test_the_last_timeout_is_raised(fake_start):
    outcomes, calls, recorded = fake_start
    outcomes += [RuntimeError(GCS_PORT_TIMEOUT)] * local_ray.START_ATTEMPTS
    with pytest.raises(RuntimeError, match="Timed out waiting for file"):
        local_ray.start(num_cpus=2)
    assert len(calls) == local_ray.START_ATTEMPTS and recorded == []


def test_any_other_failure_is_raised_without_a_retry(fake_start):
    outcomes, calls, recorded = fake_start
    outcomes += [ValueError("num_cpus must be positive")]
    with pytest.raises(ValueError, match="num_cpus"):
        local_ray.start(num_cpus=2)
    assert len(calls) == 1 and recorded == []


def test_a_start_that_failed_on_a_full_disk_is_one_line_naming_it(fake_start, monkeypatch,
                                                                  tmp_path):
    """TMPDIR full: Ray's dashboard failed to start, Ray raised its log's last lines (and
    `e from e`), and the command printed a traceback that said nothing of the disk."""
    import errno
    import shutil

    outcomes, calls, recorded = fake_start
    outcomes += [Exception("\nthe dashboard's last lines")]
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(local_ray.shutil, "disk_usage",
                        lambda path: usage._replace(free=3 * 2**20))
    with pytest.raises(OSError, match=rf"^\[Errno 28\] no space left on the disk of {tmp_path}, "
                       r"where the local Ray keeps its session \(3.0 MiB free\): free space "
                       "there, or set TMPDIR to a folder with room") as raised:
        local_ray.start(num_cpus=2)
    assert raised.value.errno == errno.ENOSPC
    assert len(calls) == 1 and recorded == []  # not retried into the same wall
