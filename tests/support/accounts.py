"""Real second accounts for the security tests: ``sc_alice`` and ``sc_bob`` in the group
``sc_team``, and ``sc_carol`` outside it, made with ``groupadd``/``useradd`` when the tests run
as root (idempotent), and code run as one of them in a real process.

Without root the tests skip with the reason; with ``SHARDCACHE_REQUIRE_ACCOUNTS=1`` (CI, which
runs as root) accounts that cannot be made are a failure instead."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

TEAM = "sc_team"
MEMBERS = ("sc_alice", "sc_bob")
OUTSIDER = "sc_carol"


@dataclass(frozen=True)
class Account:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]

    def run(self, code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
        """Run Python ``code`` in a real process of this account: real, effective and saved
        uid and gid, its groups, no capabilities.

        The process starts as root and drops to the account once shardcache and what
        ``code`` needs are imported (as daemons drop privileges): the interpreter may live
        where only root can reach it (a pyenv under /root), and this works wherever it is."""
        args, kwargs = self._command(code, env, cwd)
        return subprocess.run(
            args, capture_output=True, text=True, timeout=120, check=False, **kwargs
        )

    def popen(self, code: str, env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
        """Start ``code`` as this account (as :meth:`run`), stdin and stdout piped."""
        args, kwargs = self._command(code, env, cwd)
        return subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, **kwargs
        )

    def _command(self, code: str, env: dict[str, str], cwd: Path) -> tuple[list[str], dict]:
        prelude = (
            "import fcntl, grp, hashlib, json, os, pwd, sys, tarfile, pathlib\n"
            "import shardcache, shardcache._cache.shard_cache, fsspec.implementations.local\n"
            # What json.loads may look up for odd bytes, while the stdlib is reachable:
            "import encodings.utf_16_be, encodings.utf_16_le, encodings.utf_32_be\n"
            "import encodings.utf_32_le, encodings.utf_16, encodings.utf_32\n"
            f"os.setgroups({list(self.groups)!r}); os.setgid({self.gid}); os.setuid({self.uid})\n"
            f"assert os.getresuid() == ({self.uid},) * 3 and os.getresgid() == ({self.gid},) * 3\n"
            "assert int(open('/proc/self/status').read().split('CapEff:')[1].split()[0], 16) == 0\n"
            "os.umask(0o022)\n"
        )
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), **env}
        return [sys.executable, "-c", prelude + code], {"env": env, "cwd": cwd}


def _unavailable(reason: str) -> None:
    if os.environ.get("SHARDCACHE_REQUIRE_ACCOUNTS") == "1":
        pytest.fail(f"SHARDCACHE_REQUIRE_ACCOUNTS=1 but {reason}")
    pytest.skip(reason)


def _create_missing() -> None:
    try:
        grp.getgrnam(TEAM)
    except KeyError:
        subprocess.run(["groupadd", TEAM], check=True, capture_output=True, timeout=60)
    for name in (*MEMBERS, OUTSIDER):
        try:
            pwd.getpwnam(name)
        except KeyError:
            extra = ["-G", TEAM] if name in MEMBERS else []
            subprocess.run(
                ["useradd", "-M", "-s", "/usr/sbin/nologin", "-U", *extra, name],
                check=True,
                capture_output=True,
                timeout=60,
            )


def _account(name: str) -> Account:
    entry = pwd.getpwnam(name)
    groups = tuple(g.gr_gid for g in grp.getgrall() if name in g.gr_mem)
    return Account(name, entry.pw_uid, entry.pw_gid, groups)


def make_accounts() -> dict[str, Account]:
    """The three accounts by name, made if missing (the ``accounts`` fixture)."""
    if os.geteuid() != 0:
        _unavailable("needs root to create the second accounts (useradd)")
    if shutil.which("useradd") is None or shutil.which("groupadd") is None:
        _unavailable("needs useradd and groupadd (the passwd package)")
    _create_missing()
    return {name: _account(name) for name in (*MEMBERS, OUTSIDER)}


@contextlib.contextmanager
def world_tmp() -> Iterator[Path]:
    """A directory every account can reach (pytest's tmp_path is root's alone, 0700), like
    a node's /tmp: world-writable with the sticky bit (the ``shared_tmp`` fixture)."""
    path = Path(tempfile.mkdtemp(prefix="shardcache-security-"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
