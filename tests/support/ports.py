"""Loopback ports a test hands to a process it starts, reserved while the test runs.

A port found free by binding it and closing the socket ("just free") can be taken before
the process the test starts binds it: by another test's server binding port 0, or as an
outgoing connection's own port. :func:`reserved_port` keeps it bound, not listening, for
the whole block instead: the kernel gives it to no one else, a server that binds it with
``SO_REUSEADDR`` (torch's ``TCPStore``, shardcache's rendezvous store) still can, and a
connection to it is refused until one listens."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def reserved_port() -> Iterator[int]:
    """A port on 127.0.0.1, bound (``SO_REUSEADDR``, not listening) for the block's life."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        yield int(holder.getsockname()[1])
