"""The one address a node's mesh server binds: the local end of the route to the job's
store host, which is the cluster interface by construction (a UDP socket ``connect``\\ ed to
it and ``getsockname``: no packet is sent). Never a wildcard address. And the speed of the
interface that holds it, for the default upload cap.
"""

from __future__ import annotations

import fcntl
import socket
import struct
from pathlib import Path

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


_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
_SYS_NET = Path("/sys/class/net")


def link_rate(address: str) -> float | None:
    """Bytes per second of the interface that holds the IPv4 ``address``, as the kernel gives
    its speed (``/sys/class/net/<interface>/speed``, Mb/s); None where it is unknown (loopback,
    a bridge's ports that give none, an IPv6 address, a link that is down)."""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            try:
                mbits = int((_SYS_NET / name / "speed").read_text().strip())
            except (OSError, ValueError):
                return None
            return mbits * 125_000.0 if mbits > 0 else None
    return None


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            answer = fcntl.ioctl(
                probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15])
            )
        except OSError:  # no IPv4 address, or the interface went
            return None
    return socket.inet_ntoa(answer[20:24])
