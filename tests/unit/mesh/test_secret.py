"""The mesh secret's sources: the job's given secret, else the user's private key file."""

from __future__ import annotations

import logging
import os
import pwd
import threading
from pathlib import Path

import pytest

from shardcache import ConfigError, Settings
from shardcache._mesh.secret import default_key_file, fingerprint, job_secret, key_file_secret


def test_the_given_secret_wins_over_the_key_file(tmp_path: Path) -> None:
    given = Settings.resolve(env={"SHARDCACHE_MESH_SECRET": " " + "a" * 16 + "\n"}).mesh_secret
    assert job_secret(given, tmp_path / "mesh.key") == b"a" * 16
    assert not (tmp_path / "mesh.key").exists()  # not even made


def test_without_a_given_secret_the_key_file_is_made_and_read(tmp_path: Path) -> None:
    key = tmp_path / "cfg" / "mesh.key"
    first = job_secret(None, key)
    assert first is not None and first == key_file_secret(key) == job_secret(None, key)


def test_without_a_usable_secret_the_mesh_is_off_with_one_warning_naming_both_ways(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")
    readable = tmp_path / "readable.key"
    key_file_secret(readable)
    readable.chmod(0o644)
    for key, why in ((blocked / "mesh.key", "cannot be made"), (readable, "others may read")):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="shardcache.mesh"):
            assert job_secret(None, key) is None
        [record] = caplog.records
        text = record.getMessage()
        assert why in text and "SHARDCACHE_MESH_SECRET" in text and str(key) in text
        assert "mesh stays off" in text


def test_the_default_key_file_is_in_the_users_home_from_the_password_database(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOME", "/somewhere/else")
    home = Path(pwd.getpwuid(os.geteuid()).pw_dir)
    assert default_key_file() == home / ".config" / "shardcache" / "mesh.key"


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
