"""driver_teardown (cluster/local_ray.py) turns SIGTERM/SIGHUP into an exit only where they
would kill the process anyway: a SIGHUP that `nohup` ignores stays ignored."""

import signal

from bertforge.cluster.local_ray import driver_teardown


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
