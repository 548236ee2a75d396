"""The mesh secret's sources: the job's given secret, else the user's private key file."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from shardcache import ConfigError
from shardcache._mesh.secret import fingerprint, given_secret, key_file_secret


def test_a_given_secret_needs_16_bytes() -> None:
    assert given_secret(" " + "a" * 16 + "\n") == b"a" * 16
    with pytest.raises(ConfigError, match="at least 16"):
        given_secret("short")


def test_the_key_file_is_made_private_once_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "home" / ".config" / "shardcache" / "mesh.key"
    first = key_file_secret(path)
    assert len(first) == 64 and key_file_secret(path) == first
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert fingerprint(first) == fingerprint(key_file_secret(path)) != fingerprint(b"x" * 64)


def test_processes_making_the_key_at_once_get_the_same_one(tmp_path: Path) -> None:
    path, start, got = tmp_path / "mesh.key", threading.Barrier(8), []

    def make() -> None:
        start.wait(5)
        got.append(key_file_secret(path))

    threads = [threading.Thread(target=make) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(got) == 8 and len(set(got)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["mesh.key"]  # no temp file left


def test_a_key_others_may_read_a_link_or_another_users_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "mesh.key"
    key_file_secret(path)
    path.chmod(0o640)
    with pytest.raises(ConfigError, match="others may read it"):
        key_file_secret(path)
    path.chmod(0o600)
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(ConfigError, match="symbolic link"):
        key_file_secret(link)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
        with pytest.raises(ConfigError, match="not a regular file owned by"):
            key_file_secret(path)
