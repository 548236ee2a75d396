"""The one address a node's mesh server binds: the local end of the route to the job's
store host, which is the cluster interface by construction (a UDP socket ``connect``\\ ed to
it and ``getsockname``: no packet is sent). Never a wildcard address.
"""

from __future__ import annotations

import socket

from .._base.errors import ConfigError

_DISCARD_PORT = 9  # any port: a UDP connect only picks the route


def cluster_address(store_host: str) -> str:
    """The local address this node reaches ``store_host`` (the rendezvous store's host) from."""
    try:
        family, kind, proto, _, target = socket.getaddrinfo(
            store_host, _DISCARD_PORT, type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(target)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ConfigError(
            f"The cache mesh found no route to the job's store host {store_host!r} ({exc}); "
            "expected a host name or address this node reaches. Set SHARDCACHE_MESH_ADDR to "
            "this node's address on the cluster network.",
            name="SHARDCACHE_MESH_ADDR",
            value=store_host,
        ) from exc
