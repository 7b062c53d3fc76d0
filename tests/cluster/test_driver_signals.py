"""driver_teardown (cluster/launch/local_ray.py) turns SIGTERM/SIGHUP/SIGINT into a clean stop only
where they would end the process anyway: a SIGHUP that `nohup` ignores stays ignored. A real
`bertforge train` stopped by SIGTERM, and resumed: tests/cluster/test_train_from_outside.py."""

import signal

from bertforge.cluster.launch.local_ray import driver_teardown


def test_ignored_sighup_stays_ignored_and_default_sigterm_is_handled_then_restored():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    previous_term = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with driver_teardown():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, previous)
        signal.signal(signal.SIGTERM, previous_term)


def test_an_ignored_sigint_stays_ignored_and_a_default_one_is_handled():
    """A script's `bertforge train &` starts with SIGINT ignored (the shell's doing): taking it
    back would let a Ctrl-C meant for the script's foreground command stop the run too."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with driver_teardown():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's Ctrl-C
        with driver_teardown():
            assert signal.getsignal(signal.SIGINT) not in (signal.SIG_IGN,
                                                           signal.default_int_handler)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_signal_is_a_stop_however_ray_surfaces_it(monkeypatch):
    from bertforge.cluster.launch import local_ray

    monkeypatch.setattr(local_ray, "_RECEIVED", [])
    assert local_ray.as_stop(SystemExit(0)) is None and local_ray.as_stop(SystemExit(1)) is None
    # ray.init's own handler, before ours is back: sys.exit(15)
    assert local_ray.as_stop(SystemExit(15)).code == 143
    # Ours, raised inside ray.get's C++ wait, comes out as Ray's SystemExit(1).
    local_ray._RECEIVED.append(signal.SIGINT)
    stop = local_ray.as_stop(SystemExit(1))
    assert stop.code == 130 and stop.describe() == "stopped by SIGINT"


def test_a_second_signal_does_not_cut_the_stop_short(monkeypatch):
    """The first stop unwinds (workers stopped, Ray shut down, the lock released); a second
    Ctrl-C during that raised again and cut it short, leaving the lock behind."""
    import pytest

    from bertforge.cluster.launch import local_ray

    monkeypatch.setattr(local_ray, "_RECEIVED", [])
    with pytest.raises(local_ray.StoppedBySignal):
        local_ray._exit_on_signal(signal.SIGINT, None)
    assert local_ray._exit_on_signal(signal.SIGINT, None) is None  # ignored: the stop goes on
    assert local_ray.as_stop(SystemExit(1)).describe() == "stopped by SIGINT"


def test_a_stop_during_the_shutdown_of_a_finished_command_ends_nothing(monkeypatch):
    """A SIGTERM (a scheduler's timeout) in the seconds Ray takes to shut down after a command
    finished said "stopped by SIGTERM" and exited 143: the finished run recorded as failed."""
    import os

    from bertforge.cluster.launch import local_ray

    def shutdown_that_is_signalled():
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(local_ray, "shutdown", shutdown_that_is_signalled)
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with driver_teardown():
            pass  # the command's work, done
        assert local_ray._RECEIVED == [signal.SIGTERM]  # received, and it ended nothing
        import pytest

        with pytest.raises(local_ray.StoppedBySignal):  # one inside the work still stops it
            with driver_teardown():
                os.kill(os.getpid(), signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
