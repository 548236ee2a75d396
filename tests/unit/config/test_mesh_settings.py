"""The cache mesh's settings: each one's accepted forms, the errors that say what to do, and a
secret that never shows in a repr, ``shardcache config`` or an error."""

from __future__ import annotations

import pytest

from shardcache import ConfigError, Settings
from shardcache._config.display import format_setting

SECRET = "s3cr3t-" + "x" * 20


def test_the_mesh_is_off_by_default_and_its_defaults() -> None:
    s = Settings.resolve(env={})
    assert (s.mesh, s.mesh_addr, s.mesh_secret, s.mesh_upload_rate) == (False, None, None, None)
    assert (s.mesh_concurrency, s.mesh_timeout, s.mesh_min_rate) == (8, 2.0, 20_000_000)


@pytest.mark.parametrize(
    ("text", "on"),
    [("1", True), ("on", True), ("TRUE", True), ("yes", True), ("0", False), ("off", False)],
)
def test_the_switch(text: str, on: bool) -> None:
    assert Settings.resolve(env={"SHARDCACHE_MESH": text}).mesh is on
    assert Settings.resolve(env={}, mesh=on).mesh is on


def test_forms_of_the_values() -> None:
    env = {
        "SHARDCACHE_MESH_ADDR": " 10.0.3.17 ",
        "SHARDCACHE_MESH_UPLOAD_RATE": "500M/s",
        "SHARDCACHE_MESH_CONCURRENCY": "32",
        "SHARDCACHE_MESH_MIN_RATE": "5MiB",
        "SHARDCACHE_MESH_TIMEOUT": "1m",
    }
    s = Settings.resolve(env=env)
    assert (s.mesh_addr, s.mesh_upload_rate) == ("10.0.3.17", 500_000_000)
    assert (s.mesh_concurrency, s.mesh_min_rate, s.mesh_timeout) == (32, 5 << 20, 60.0)
    assert Settings.resolve(env={}, mesh_timeout=0.25).mesh_timeout == 0.25
    assert Settings.resolve(env={"SHARDCACHE_MESH_ADDR": "fd00::3"}).mesh_addr == "fd00::3"
    assert Settings.resolve(env={"SHARDCACHE_MESH_UPLOAD_RATE": "0"}).mesh_upload_rate == 0
    assert Settings.resolve(env={"SHARDCACHE_MESH_UPLOAD_RATE": "auto"}).mesh_upload_rate is None
    for name, value in (("mesh_upload_rate", 1_250_000_000), ("mesh_min_rate", 20_000_000)):
        shown = format_setting(name, value)  # written as the variable takes it, and read back
        assert getattr(Settings.resolve(env={f"SHARDCACHE_{name.upper()}": shown}), name) == value


@pytest.mark.parametrize(
    ("var", "value", "fragments"),
    [
        ("SHARDCACHE_MESH", "maybe", ["not a switch", "expected 1 or 0"]),
        ("SHARDCACHE_MESH_ADDR", "node7.cluster", ["not an IP address", "e.g. 10.0.3.17"]),
        ("SHARDCACHE_MESH_ADDR", "0.0.0.0", ["wildcard", "this node's IP address"]),
        ("SHARDCACHE_MESH_ADDR", "::", ["wildcard"]),
        ("SHARDCACHE_MESH_UPLOAD_RATE", "fast", ["not a rate", "100M/s"]),
        ("SHARDCACHE_MESH_UPLOAD_RATE", "-5M", ["not a rate"]),
        ("SHARDCACHE_MESH_CONCURRENCY", "0", ["between 1 and 1024"]),
        ("SHARDCACHE_MESH_CONCURRENCY", "many", ["whole number"]),
        ("SHARDCACHE_MESH_MIN_RATE", "10K", ["between 100K/s and 1T/s"]),
        ("SHARDCACHE_MESH_MIN_RATE", "slow", ["not a rate"]),
        ("SHARDCACHE_MESH_TIMEOUT", "2m", ["between 10ms and 1m"]),
        ("SHARDCACHE_MESH_TIMEOUT", "0", ["between 10ms and 1m"]),
        ("SHARDCACHE_MESH_TIMEOUT", "soon", ["duration"]),
    ],
)
def test_bad_values_say_what_to_give(var: str, value: str, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.resolve(env={var: value})
    message = str(info.value)
    assert var in message and repr(value) in message
    for fragment in fragments:
        assert fragment in message


def test_a_short_secret_is_refused_without_showing_it() -> None:
    short = "hunter2-pw"
    with pytest.raises(ConfigError) as info:
        Settings.resolve(env={"SHARDCACHE_MESH_SECRET": short})
    message = str(info.value)
    assert "SHARDCACHE_MESH_SECRET" in message and "at least 16" in message
    assert "openssl rand" in message
    assert short not in message and short not in repr(info.value.__dict__)


def test_the_secret_shows_nowhere() -> None:
    s = Settings.resolve(env={"SHARDCACHE_MESH_SECRET": SECRET})
    assert s.mesh_secret == SECRET
    assert SECRET not in repr(s)
    shown = {name: value for name, _env, value, _source in s.describe()}
    assert shown["mesh_secret"] == "***" and SECRET not in format_setting("mesh_secret", "***")
    assert SECRET not in repr(s.replace(scope="node"))
