"""A cache on a node shared by several users: nobody else can poison, read or block it; a
team shares one only on purpose (SHARDCACHE_SHARED_GROUP), and only with its group.

Attacks are made by real second accounts (tests/support/accounts.py) in real processes,
against local-file shards every account can read."""

from __future__ import annotations

import grp
import hashlib
import json
import logging
import os
import stat
import tarfile
from pathlib import Path

import pytest
from accounts import OUTSIDER, TEAM, Account

from shardcache import CacheDirError, ShardCache

pytestmark = pytest.mark.timeout(300)
ALICE, BOB = "sc_alice", "sc_bob"

# Run as another account: fetch each URL through a cache configured by the environment and
# report what happened as JSON (the content's digest, or the error's type and message).
FETCH = """
import hashlib, json, sys
from shardcache import ShardCache
results = []
try:
    cache = ShardCache()
except Exception as exc:
    print(json.dumps([{"error": type(exc).__name__, "message": str(exc)}])); sys.exit()
for url in sys.argv[1:]:
    try:
        with cache.open(url) as f:
            results.append({"sha": hashlib.sha256(f.read()).hexdigest()})
    except Exception as exc:
        results.append({"error": type(exc).__name__, "message": str(exc)})
results.append(cache.stats().as_dict())
print(json.dumps(results))
"""


def _fetch_as(
    account: Account, urls: list[str], env: dict[str, str], cwd: Path
) -> list[dict[str, object]]:
    args_code = f"import sys; sys.argv[1:] = {urls!r}\n" + FETCH
    result = account.run(args_code, env, cwd)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture
def shards(shared_tmp: Path) -> dict[str, str]:
    """Two small tar shards every account can read: URL -> SHA-256 of its bytes."""
    src = shared_tmp / "src"
    src.mkdir(mode=0o755)
    src.chmod(0o755)
    digests = {}
    for i in range(2):
        path = src / f"shard-{i}.tar"
        member = src / f"sample{i}.txt"
        member.write_text(f"sample {i}\n" * 100)
        with tarfile.open(path, "w") as tar:
            tar.add(member, arcname=member.name)
        path.chmod(0o644)
        digests[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digests


def _modes(root: Path) -> set[tuple[str, int, int]]:
    """(kind, mode, gid) of everything below ``root`` (and root itself)."""
    seen = set()
    for path in [root, *root.rglob("*")]:
        st = os.lstat(path)
        kind = "dir" if stat.S_ISDIR(st.st_mode) else "lock" if ".locks" in path.parts else "file"
        seen.add((kind, stat.S_IMODE(st.st_mode), st.st_gid))
    return seen


def test_a_root_planted_by_another_user_is_refused_not_served(
    accounts: dict[str, Account], shared_tmp: Path, shards: dict[str, str]
) -> None:
    """bob makes alice's default root ($TMPDIR/shardcache-sc_alice) first, with his bytes at
    the very path alice's cache computes for the URL: alice gets a CacheDirError naming the
    directory and its owner at once, never bob's bytes; nothing of hers is written there."""
    url = next(iter(shards))
    root = shared_tmp / f"shardcache-{ALICE}"
    plant = f"""
import os, sys
from pathlib import Path
from shardcache import ShardCache
os.umask(0)
final = ShardCache({str(root)!r}).path_for({url!r})
final.parent.mkdir(parents=True, mode=0o777)
final.write_bytes(b"bob's data")
print(final)
"""
    planted = accounts[BOB].run(plant, {}, shared_tmp)
    assert planted.returncode == 0, planted.stderr
    assert Path(planted.stdout.strip()).is_relative_to(root)
    before = sorted(root.rglob("*"))

    [outcome, stats] = _fetch_as(accounts[ALICE], [url], {"TMPDIR": str(shared_tmp)}, shared_tmp)
    assert outcome["error"] == "CacheDirError", outcome
    message = str(outcome["message"])
    assert str(root) in message and f"({BOB})" in message and "SHARDCACHE_DIR" in message
    assert stats["hits"] == 0 and stats["misses"] == 0
    assert sorted(root.rglob("*")) == before


def test_a_private_cache_cannot_be_read_or_used_by_another_user(
    accounts: dict[str, Account], shared_tmp: Path, shards: dict[str, str]
) -> None:
    urls = list(shards)
    env = {"TMPDIR": str(shared_tmp)}
    root = shared_tmp / f"shardcache-{ALICE}"
    results = _fetch_as(accounts[ALICE], urls, env, shared_tmp)
    assert [r.get("sha") for r in results[:-1]] == list(shards.values())
    alice = accounts[ALICE]
    assert _modes(root) == {("dir", 0o700, alice.gid), ("file", 0o600, alice.gid)} | {
        ("lock", 0o600, alice.gid)
    }

    # bob reads a cached shard by its path: the operating system refuses.
    cached = ShardCache(root).path_for(urls[0])
    peek = accounts[BOB].run(f"open({str(cached)!r}, 'rb').read()", {}, shared_tmp)
    assert peek.returncode != 0 and "PermissionError" in peek.stderr
    # bob points his cache at alice's: refused by name, before anything is tried.
    [outcome, _] = _fetch_as(accounts[BOB], urls[:1], {"SHARDCACHE_DIR": str(root)}, shared_tmp)
    assert outcome["error"] == "CacheDirError" and f"({ALICE})" in str(outcome["message"])
    # alice is not blocked by any of it: both shards are hits.
    again = _fetch_as(accounts[ALICE], urls, env, shared_tmp)
    assert again[-1]["hits"] == 2 and again[-1]["misses"] == 0


def test_a_group_shared_cache_works_for_its_members_only(
    accounts: dict[str, Account], shared_tmp: Path, shards: dict[str, str]
) -> None:
    urls = list(shards)
    root = shared_tmp / "team-cache"
    env = {"SHARDCACHE_DIR": str(root), "SHARDCACHE_SCOPE": "node"}
    team = {**env, "SHARDCACHE_SHARED_GROUP": TEAM}
    first = _fetch_as(accounts[ALICE], urls[:1], team, shared_tmp)
    assert first[0].get("sha") == shards[urls[0]] and first[-1]["misses"] == 1
    # bob, in the group: alice's shard is a hit; his own is a miss that alice then hits.
    second = _fetch_as(accounts[BOB], urls, team, shared_tmp)
    assert [r.get("sha") for r in second[:-1]] == list(shards.values())
    assert (second[-1]["hits"], second[-1]["misses"]) == (1, 1)
    third = _fetch_as(accounts[ALICE], urls, team, shared_tmp)
    assert (third[-1]["hits"], third[-1]["misses"]) == (2, 0)
    gid = grp.getgrnam(TEAM).gr_gid
    assert root.stat().st_gid == gid
    # Directories setgid and group-writable, shards group-readable, lock files
    # group-writable, all group-owned; nothing for others.
    assert _modes(root) == {("dir", 0o2770, gid), ("file", 0o640, gid), ("lock", 0o660, gid)}

    # carol, outside the group: asking for the group is refused; without it, the cache is
    # not hers and is refused too.
    carol = accounts[OUTSIDER]
    [asked] = _fetch_as(carol, urls[:1], team, shared_tmp)
    assert asked["error"] == "ConfigError" and "not a member" in str(asked["message"])
    [outcome, _] = _fetch_as(carol, urls[:1], env, shared_tmp)
    assert outcome["error"] == "CacheDirError" and "Refusing to use" in str(outcome["message"])
    # A member without the setting uses it as a private cache: refused as well (the root is
    # group-writable), rather than silently creating private files inside a shared tree.
    [outcome, _] = _fetch_as(accounts[BOB], urls[:1], env, shared_tmp)
    assert outcome["error"] == "CacheDirError"


def test_a_cached_file_others_could_write_is_not_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = tmp_path / "shard.tar"
    source.write_bytes(b"the source's bytes" * 100)
    cache = ShardCache(tmp_path / "cache")
    cached = cache.fetch(str(source))
    assert stat.S_IMODE(cached.stat().st_mode) == 0o600
    cached.write_bytes(b"planted")
    cached.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        again = cache.fetch(str(source))
    assert again.read_bytes() == source.read_bytes()
    assert stat.S_IMODE(again.stat().st_mode) == 0o600
    assert (cache.stats().hits, cache.stats().misses) == (0, 2)
    assert any("not serving" in r.getMessage() for r in caplog.records)


def test_a_directory_others_could_write_is_refused(tmp_path: Path) -> None:
    source = tmp_path / "shard.tar"
    source.write_bytes(b"x" * 1000)
    cache = ShardCache(tmp_path / "cache")
    data_dir = cache.fetch(str(source)).parent.parent
    data_dir.chmod(0o770)
    Path(cache.path_for(str(source))).unlink()
    with pytest.raises(CacheDirError, match="writable by no one else") as caught:
        cache.fetch(str(source))
    assert caught.value.path == str(data_dir) and caught.value.mode == 0o770


def test_a_member_cannot_block_or_hang_the_others(
    accounts: dict[str, Account], shared_tmp: Path, shards: dict[str, str]
) -> None:
    """In a shared cache bob can write lock files and records. He holds the flock of one
    shard forever, and plants FIFOs (reads of which would wait forever) as its owner record
    and as the other shard's metadata record: alice gets a LockTimeout for the first after
    SHARDCACHE_LOCK_STUCK_AFTER, and the second shard, fetched, is served."""
    blocked, other = list(shards)
    root = shared_tmp / "team-cache"
    team = {
        "SHARDCACHE_DIR": str(root),
        "SHARDCACHE_SCOPE": "node",
        "SHARDCACHE_SHARED_GROUP": TEAM,
        "SHARDCACHE_LOCK_STUCK_AFTER": "1s",
    }
    hold = f"""
from shardcache import ShardCache
cache = ShardCache()
url = {blocked!r}
lock = cache._identify(url).lock_path
cache.layout.make_dir(lock.parent)
fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o660)
fcntl.flock(fd, fcntl.LOCK_EX)
os.mkfifo(lock.with_suffix(".owner"), 0o660)
meta = cache.layout.meta_path(cache.path_for({other!r}))
cache.layout.make_dir(meta.parent)
os.mkfifo(meta, 0o660)
print("held", flush=True)
sys.stdin.read()  # until the test closes our stdin
"""
    holder = accounts[BOB].popen(hold, team, shared_tmp)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        results = _fetch_as(accounts[ALICE], [blocked, other], team, shared_tmp)
    finally:
        holder.communicate(timeout=60)
    assert results[0]["error"] == "LockTimeout", results[0]
    assert "no readable owner record" in str(results[0]["message"]), results[0]
    assert results[1].get("sha") == shards[other]


def test_in_a_shared_cache_only_the_chosen_group_may_write(
    accounts: dict[str, Account], shared_tmp: Path, shards: dict[str, str]
) -> None:
    """A directory of the user's own that another group can write is refused in a shared
    cache too: trust extends to the chosen group, not to any group."""
    url = next(iter(shards))
    root = shared_tmp / "team-cache"
    team = {"SHARDCACHE_DIR": str(root), "SHARDCACHE_SCOPE": "node"}
    team["SHARDCACHE_SHARED_GROUP"] = TEAM
    first = _fetch_as(accounts[ALICE], [url], team, shared_tmp)
    assert first[0].get("sha") == shards[url]
    alice = accounts[ALICE]
    data = root / "node" / "data"
    os.chown(data, alice.uid, alice.gid)  # her own primary group, still group-writable
    cached = ShardCache(root, scope="node").path_for(url)
    cached.unlink()
    [outcome, _] = _fetch_as(alice, [url], team, shared_tmp)
    assert outcome["error"] == "CacheDirError", outcome
    assert str(data) in str(outcome["message"]) and f"group {alice.gid}" in str(outcome["message"])


def test_a_relative_cache_dir_stays_where_it_was_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "shard.tar"
    source.write_bytes(b"x" * 1000)
    monkeypatch.chdir(tmp_path)
    cache = ShardCache("relative-cache")
    path = cache.fetch(str(source))
    assert path.is_absolute() and path.is_relative_to(tmp_path / "relative-cache")
    monkeypatch.chdir("/")
    with cache.open(str(source)) as f:
        assert f.read() == source.read_bytes()
    assert (cache.stats().hits, cache.stats().misses) == (1, 1)
