"""The mesh server's address: the local end of the route to the store host."""

from __future__ import annotations

import pytest

from shardcache import ConfigError
from shardcache._mesh.address import cluster_address


def test_the_route_to_a_loopback_store_is_loopback() -> None:
    assert cluster_address("127.0.0.1") == "127.0.0.1"
    assert cluster_address("127.0.0.9") == "127.0.0.1"  # the route's source, not the target
    assert cluster_address("localhost") in {"127.0.0.1", "::1"}


def test_a_host_that_does_not_resolve_names_the_setting() -> None:
    with pytest.raises(ConfigError, match="SHARDCACHE_MESH_ADDR") as failed:
        cluster_address("no-such-host.invalid")
    assert failed.value.value == "no-such-host.invalid"
