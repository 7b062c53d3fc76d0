"""The `pymp-*` folders a local Ray's dashboard leaves behind are removed once it stopped
(cluster/launch/multiprocessing_dirs.py); nothing alive or foreign is touched. The end to end
check, a real `bertforge train` leaving none: tests/cluster/test_train_from_outside.py."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from bertforge.cluster.launch import multiprocessing_dirs

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the kernel lists its unix sockets in /proc on Linux")


def bound_socket(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen()
    return sock


def test_only_new_folders_of_dead_sockets_are_removed(tmp_path, monkeypatch):
    # A short directory: unix socket paths are limited to 107 characters.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # gettempdir() reads TMPDIR again
    old = tmp_path / "pymp-old"  # there before the Ray started, dead or not
    old.mkdir()
    bound_socket(str(old / "listener-1")).close()
    before = multiprocessing_dirs.present()
    assert before == {str(old)}

    dead, live, other = (tmp_path / f"pymp-{name}" for name in ("dead", "live", "other"))
    for folder in (dead, live, other):
        folder.mkdir()
    bound_socket(str(dead / "listener-1")).close()  # its process is gone: the file stays
    listener = bound_socket(str(live / "listener-1"))  # a running program's forkserver
    (other / "notes.txt").write_text("not a socket")
    (tmp_path / "pymp-empty").mkdir()  # a live process's, about to bind its socket there
    try:
        removed = multiprocessing_dirs.remove_dead(since=before)
        assert removed == [str(dead)]
        assert sorted(os.listdir(tmp_path)) == ["pymp-empty", "pymp-live", "pymp-old",
                                                "pymp-other"]
        assert os.path.exists(live / "listener-1")
    finally:
        listener.close()
    assert multiprocessing_dirs.remove_dead(since=before) == [str(live)]  # dead now
