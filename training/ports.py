"""A free TCP port on the loopback address: for torch's rendezvous of a one-process run and
for a private local Ray's dashboard (kept light: the driver imports it before torch)."""

from __future__ import annotations

import socket


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the system's choice; another process may take it
    before the caller binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
