"""status / clean / verify: real lock holders in child processes, SIGKILLed downloaders,
files altered behind the cache's back, against a real moto S3 server."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from shardcache import ShardCache
from shardcache._base.safefs import SafeFS
from shardcache._base.trust import Trust
from shardcache._cli.main import main
from shardcache._disk.layout import CacheLayout
from shardcache._disk.metadata import read_meta, write_meta
from shardcache._locking.lease import remove_lease_if_unchanged
from shardcache._locking.policy import LockPolicy
from shardcache._locking.shard_lock import ShardLock
from shardcache._ops.maintenance import clean, status
from shardcache._ops.verify import verify
from shardcache._store.pins import is_held

CTX = mp.get_context("spawn")
BUCKET = "maint"
WAIT = 30.0  # bound on every handshake with a child process
NOT_AN_MD5 = '"0123456789abcdef0123456789abcdef"'


def _hold_lock(lock_path: str, mode: str, url: str, ready: Any, release: Any) -> None:
    """Child: hold a shard lock mid-"download" until told to release."""
    lock = ShardLock(Path(lock_path), url=url, policy=LockPolicy(mode=mode, timeout=WAIT))
    with lock.hold() as held:
        assert held
        lock.heartbeat(phase="downloading", bytes_done=10, bytes_total=100)
        ready.set()
        release.wait(60)


def _start_download(final: str, ready: Any, release: Any) -> None:
    """Child: a download's temp file, partly written, until killed or released."""
    part = CacheLayout.temp_path(Path(final))
    part.write_bytes(b"x" * 1000)
    ready.set()
    release.wait(60)


@contextmanager
def _child(target: Callable[..., None], *args: Any, kill: bool = False) -> Iterator[int]:
    """Run ``target(*args, ready, release)`` in a spawned process; yields its pid once ready.
    ``kill``: SIGKILL it as soon as it is ready (it leaves its files behind)."""
    ready, release = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=target, args=(*args, ready, release))
    proc.start()
    try:
        assert ready.wait(WAIT), "child did not get ready"
        assert proc.pid is not None
        if kill:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(WAIT)
            assert proc.exitcode == -signal.SIGKILL
        yield proc.pid
    finally:
        if not kill:  # (set() would wait forever for a killed waiter to acknowledge)
            release.set()
        proc.join(WAIT)
        if proc.is_alive():
            proc.kill()
            proc.join(WAIT)


def _lock_path(cache: ShardCache, url: str) -> Path:
    return cache._identify(url).lock_path


def _final(cache: ShardCache, url: str) -> Path:
    final = cache.path_for(url)
    final.parent.mkdir(parents=True, exist_ok=True)
    return final


def _write_meta(cache: ShardCache, final: Path, url: str) -> Path:
    meta = cache.layout.meta_path(final)
    meta.parent.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps({"url": url, "size": 3}))
    return meta


def _leftovers_and_live_files(cache: ShardCache) -> dict[str, Path]:
    """Files of killed processes (stale or orphan) beside live ones of this process."""
    dead_url = "s3://b/dead.tar"
    dead_lease = _lock_path(cache, dead_url).with_suffix(".lease")
    with _child(_hold_lock, str(_lock_path(cache, dead_url)), "lease", dead_url, kill=True):
        pass
    assert dead_lease.exists()
    claim = dead_lease.with_name(f"{dead_lease.stem}.0123abcd.claim")  # a killed claimer's
    claim.write_bytes(dead_lease.read_bytes())

    crashed = _final(cache, "s3://b/crashed.tar")
    with _child(_start_download, str(crashed), kill=True):
        pass
    [orphan_part] = [p for p in crashed.parent.iterdir() if p.name.endswith(".part")]
    crashed_meta = _write_meta(cache, crashed, "s3://b/crashed.tar")  # died before publish

    mine = _final(cache, "s3://b/mine.tar")
    my_part = CacheLayout.temp_path(mine)  # this (living) process's download
    my_part.write_bytes(b"abc")
    my_meta = _write_meta(cache, mine, "s3://b/mine.tar")  # about to be published
    gone_meta = _write_meta(cache, cache.path_for("s3://b/gone.tar"), "s3://b/gone.tar")
    published = _final(cache, "s3://b/ok.tar")
    published.write_bytes(b"ok!")
    ok_meta = _write_meta(cache, published, "s3://b/ok.tar")

    return {
        "dead_lease": dead_lease,
        "claim": claim,
        "orphan_part": orphan_part,
        "crashed_meta": crashed_meta,
        "gone_meta": gone_meta,
        "my_part": my_part,
        "my_meta": my_meta,
        "published": published,
        "ok_meta": ok_meta,
    }


def test_status_and_clean_judge_every_lock_and_temp_file(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    root = cache.layout.scope_dir
    held_url, lease_url = "s3://b/held.tar", "s3://b/leased.tar"
    with (
        _child(_hold_lock, str(_lock_path(cache, held_url)), "flock", held_url) as flock_pid,
        _child(_hold_lock, str(_lock_path(cache, lease_url)), "lease", lease_url) as lease_pid,
    ):
        f = _leftovers_and_live_files(cache)
        dead_lease, claim, orphan_part = f["dead_lease"], f["claim"], f["orphan_part"]
        crashed_meta, gone_meta = f["crashed_meta"], f["gone_meta"]
        my_part, my_meta, published, ok_meta = (
            f["my_part"],
            f["my_meta"],
            f["published"],
            f["ok_meta"],
        )

        report = status(cache)
        held = {lock.url: lock for lock in report.locks_held}
        assert set(held) == {held_url, lease_url}
        assert held[held_url].mode == "flock" and held[lease_url].mode == "lease"
        assert held[held_url].holder["pid"] == flock_pid
        assert held[lease_url].holder["pid"] == lease_pid
        assert {lock.verdict for lock in held.values()} == {"alive"}
        assert held[held_url].holder["phase"] == "downloading"
        assert {(i.path, i.kind) for i in report.stale_locks} == {
            (dead_lease, "lease"),
            (claim, "claim"),
        }
        assert {(i.path, i.kind) for i in report.orphans} == {
            (orphan_part, "part"),
            (crashed_meta, "meta"),
            (gone_meta, "meta"),
        }
        assert (report.entries, report.bytes, report.downloads) == (1, 3, 1)
        text = report.format()
        assert f"pid {flock_pid}" in text and f"pid {lease_pid}" in text
        assert "no longer exists" in text
        assert json.loads(json.dumps(report.as_json()))["locks_held"][0]["holder"]["pid"] in (
            flock_pid,
            lease_pid,
        )

        lock_files = sorted(root.rglob("*.lock"))
        owners = sorted(root.rglob("*.owner"))
        assert lock_files and owners
        cleaned = clean(cache)
        assert {i.path for i in cleaned.removed} == {
            dead_lease,
            claim,
            orphan_part,
            crashed_meta,
            gone_meta,
        }
        assert cleaned.kept == [] and cleaned.failed == []
        assert (cleaned.live_locks, cleaned.live_downloads) == (2, 1)
        for path in [*lock_files, *owners, my_part, my_meta, published, ok_meta]:
            assert path.exists(), path
        assert _lock_path(cache, lease_url).with_suffix(".lease").exists()
        assert is_held(cache.layout.fs, _lock_path(cache, held_url))

        after = status(cache)
        assert (after.stale_locks, after.orphans) == ([], [])
        assert len(after.locks_held) == 2
    # Holders gone: their flock is free, and a lease released normally leaves nothing.
    final = status(cache)
    assert (final.locks_held, final.stale_locks, final.orphans) == ([], [], [])


def test_status_and_clean_from_the_command_line(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    url = "s3://b/held.tar"
    crashed = _final(cache, "s3://b/crashed.tar")
    with _child(_start_download, str(crashed), kill=True) as dead_pid:
        pass
    env = {**os.environ, "SHARDCACHE_DIR": str(tmp_path / "cache")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shardcache", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    with _child(_hold_lock, str(_lock_path(cache, url)), "flock", url) as pid:
        shown = run("status")
        assert shown.returncode == 0, shown.stderr
        assert f"{url} (flock): host " in shown.stdout and f" pid {pid} " in shown.stdout
        assert "orphans     1" in shown.stdout
        assert f"pid {dead_pid} no longer exists" in shown.stdout
        as_json = json.loads(run("status", "--json").stdout)
        assert [lock["holder"]["pid"] for lock in as_json["locks_held"]] == [pid]
        dry = run("clean", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.startswith(
            f"clean {cache.layout.scope_dir}: would remove 1 (1.0 KB); --dry-run: nothing removed"
        )
        assert f"pid {dead_pid} no longer exists" in dry.stdout
        assert json.loads(run("clean", "-n", "--json").stdout)["dry_run"] is True
        assert len(json.loads(run("status", "--json").stdout)["orphans"]) == 1  # still there
        cleaned = run("clean")
        assert cleaned.returncode == 0, cleaned.stderr
        assert cleaned.stdout.startswith(f"clean {cache.layout.scope_dir}: removed 1 (1.0 KB)")
        assert "left alone: 1 held lock(s), 0 download(s) in progress" in cleaned.stdout
        assert json.loads(run("status", "--json").stdout)["orphans"] == []


def test_status_and_clean_all_cover_every_scope_directory_of_the_root(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    sources = tmp_path / "src"
    sources.mkdir()
    for name, size in (("a.tar", 1000), ("b.tar", 3000)):
        (sources / name).write_bytes(b"x" * size)
    fetched = {("rank", 0): ["a.tar"], ("rank", 12): ["a.tar", "b.tar"], ("node", 0): ["b.tar"]}
    for (scope, rank), names in fetched.items():
        cache = ShardCache(root, scope=scope, rank=rank)
        for name in names:
            cache.fetch(str(sources / name))
    crashed = _final(ShardCache(root, scope="rank", rank=12), "s3://b/crashed.tar")
    with _child(_start_download, str(crashed), kill=True) as dead_pid:
        pass
    (root / "rank-x").mkdir()  # not a scope directory: left out
    (root / "rank-7").symlink_to(tmp_path)  # a link is never followed
    env = {**os.environ, "SHARDCACHE_DIR": str(root)}

    def run(*args: str, command: str = "status") -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shardcache", command, *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    shown = run("--all")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0] == f"cache root  {root}: 3 scope directories"
    assert lines[1].split() == [
        "scope",
        "shards",
        "bytes",
        "in",
        "use",
        "downloads",
        "locks",
        "stale",
        "orphans",
    ]
    assert lines[2].split()[:3] == ["node", "1", "3.0"]
    assert lines[3].split()[:3] == ["rank-0", "1", "1.0"]
    assert lines[4].split()[:2] == ["rank-12", "2"] and lines[4].split()[-1] == "1"
    assert "rank-12: orphan download: " in shown.stdout
    assert f"pid {dead_pid} no longer exists" in shown.stdout
    assert "run 'shardcache clean --all' to remove the stale locks and orphans of rank-12" in (
        shown.stdout
    )
    scopes = json.loads(run("--all", "--json").stdout)["scopes"]
    assert [(Path(s["scope_dir"]).name, s["entries"], s["bytes"]) for s in scopes] == [
        ("node", 1, 3000),
        ("rank-0", 1, 1000),
        ("rank-12", 2, 4000),
    ]
    refused = run("--all", "--rank", "3")
    assert refused.returncode == 2 and "without --scope or --rank" in refused.stderr
    refused = run("--all", "--scope", "node", command="clean")
    assert refused.returncode == 2 and "give clean --all without --scope" in refused.stderr
    assert crashed.parent.exists() and any(crashed.parent.iterdir())

    cleaned = run("--all", "--json", command="clean")
    assert cleaned.returncode == 0, cleaned.stderr
    removed = {
        Path(s["scope_dir"]).name: [Path(r["path"]).parent for r in s["removed"]]
        for s in json.loads(cleaned.stdout)["scopes"]
    }
    assert removed == {"node": [], "rank-0": [], "rank-12": [crashed.parent]}
    after = json.loads(run("--all", "--json").stdout)["scopes"]
    assert [(s["entries"], s["orphans"], s["stale_locks"]) for s in after] == [(1, [], [])] * 2 + [
        (2, [], [])
    ]
    again = run("--all", command="clean")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith(f"cache root  {root}: 3 scope directories, removed 0 (0 B)\n")
    assert f"clean {root / 'rank-12'}: removed 0" in again.stdout
    missing = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardcache",
            "status",
            "--all",
            "--cache-dir",
            str(tmp_path / "no"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )
    assert missing.returncode != 0 and f"cannot list the cache root {tmp_path / 'no'}" in (
        missing.stderr
    )


def test_a_temp_file_of_another_host_is_an_orphan_only_when_old(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    final = _final(cache, "s3://b/x.tar")
    fresh = final.parent / f".{final.name}.otherhost.12345.aaaa.part"
    old = final.parent / f".{final.name}.otherhost.12345.bbbb.part"
    fresh.write_bytes(b"1")
    old.write_bytes(b"2")
    day_ago = old.stat().st_mtime - 25 * 3600
    os.utime(old, (day_ago, day_ago))
    assert [i.path for i in status(cache).orphans] == [old]
    assert [i.path for i in clean(cache).removed] == [old]
    assert fresh.exists()


def test_status_counts_shards_in_use(s3, tmp_path: Path) -> None:
    s3.put_objects(BUCKET, {"a.tar": b"a" * 100, "b.tar": b"b" * 200})
    cache = ShardCache(tmp_path / "cache")
    cache.fetch(f"s3://{BUCKET}/b.tar")
    with cache.open(f"s3://{BUCKET}/a.tar") as f:
        assert f.read() == b"a" * 100  # read to its end: published (it may be read earlier)
        report = status(cache)
        assert (report.entries, report.bytes, report.in_use) == (2, 300, 1)
    assert status(cache).in_use == 0


# ----------------------------------------------------------------------------- verify


@pytest.fixture
def cached(s3, tmp_path: Path) -> tuple[ShardCache, dict[str, bytes]]:
    objects = {f"s-{i}.tar": random.Random(i).randbytes(20_000 + i) for i in range(4)}
    s3.put_objects(BUCKET, objects)
    cache = ShardCache(tmp_path / "cache", retry_backoff=0.01)
    shards = {f"s3://{BUCKET}/{key}": data for key, data in objects.items()}
    for url in shards:
        cache.fetch(url)
    return cache, shards


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:  # in place, same size: a silent corruption
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_verify_removes_altered_shards_and_a_fetch_downloads_them_again(s3, cached) -> None:
    cache, shards = cached
    urls = list(shards)
    _flip_a_byte(cache.path_for(urls[0]))
    os.truncate(cache.path_for(urls[1]), 100)
    stray = cache.layout.data_dir / "zz" / "copied-by-hand.tar"
    stray.parent.mkdir()
    stray.write_bytes(b"who knows")

    report = verify(cache)
    assert report.failed
    bad = {i.url: i for i in report.of("bad")}
    assert set(bad) == {urls[0], urls[1]}
    assert all(i.removed for i in bad.values())
    # The checksum a download checks: the CRC32 boto3's upload asked moto to keep.
    assert bad[urls[0]].detail.startswith("crc32 ")
    assert bad[urls[1]].detail == "size 100 bytes, the remote object has 20001"
    assert [i.path for i in report.of("unknown-origin")] == [stray]
    assert len(report.of("ok")) == 2
    assert not cache.contains(urls[0]) and not cache.contains(urls[1])
    assert stray.exists()

    s3.clear_requests()
    for url in urls:
        assert cache.fetch(url).read_bytes() == shards[url]
    gets = {url: s3.count("GET", BUCKET, url.rsplit("/", 1)[1]) for url in urls}
    assert gets == {urls[0]: 1, urls[1]: 1, urls[2]: 0, urls[3]: 0}
    again = verify(cache)
    assert not again.failed and len(again.of("ok")) == 4


def test_verify_against_a_manifest_does_not_ask_the_remote(s3, cached, tmp_path) -> None:
    cache, shards = cached
    urls = list(shards)
    manifest = tmp_path / "manifest.json"
    entries = [
        {"url": url, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for url, data in shards.items()
    ]
    manifest.write_text(json.dumps(entries))
    _flip_a_byte(cache.path_for(urls[2]))
    s3.clear_requests()
    report = verify(cache, manifest)
    assert [(i.url, i.detail.split()[0]) for i in report.of("bad")] == [(urls[2], "sha256")]
    assert "the manifest has" in report.of("bad")[0].detail
    assert s3.count("HEAD", BUCKET) == 0 and s3.count("GET", BUCKET) == 0


def test_verify_notices_a_replaced_multipart_object(s3, tmp_path: Path) -> None:
    key, size = "big.tar", (5 << 20) + 1000
    s3.put_objects(BUCKET, {key: b"a" * size}, multipart_chunk=5 << 20)
    cache = ShardCache(tmp_path / "cache")
    cache.fetch(f"s3://{BUCKET}/{key}")
    assert not verify(cache).failed
    s3.put_objects(BUCKET, {key: b"b" * size}, multipart_chunk=4 << 20)
    report = verify(cache)
    [bad] = report.of("bad")
    assert bad.detail.startswith("md5-parts ")  # the ETag's MD5 of MD5s, over the parts
    assert bad.removed and not cache.contains(f"s3://{BUCKET}/{key}")


def test_status_and_verify_count_shards_by_how_they_were_verified(
    s3, fault_proxy, tmp_path: Path, monkeypatch, capsys
) -> None:
    """A CRC32 object, a multipart upload (MD5 of MD5s), an SSE-KMS object without a
    checksum (its ETag no MD5: the proxy rewrites its headers), and a copy whose record comes
    from before records said how (``unknown`` to status; verify checks it by its MD5)."""
    plain = s3.boto3_client(request_checksum_calculation="when_required")
    s3.put_objects(BUCKET, {"crc.tar": random.Random(1).randbytes(30_000)})  # boto3: CRC32
    part = 5 << 20
    plain.put_object(Bucket=BUCKET, Key="old.tar", Body=random.Random(2).randbytes(30_000))
    plain.put_object(Bucket=BUCKET, Key="kms.tar", Body=random.Random(3).randbytes(30_000))
    s3.put_objects(BUCKET, {"mp.tar": b"m" * (part + 1000)}, multipart_chunk=part)
    fault_proxy.add_fault(
        "headers",
        times=None,
        path_contains="kms.tar",
        set_headers={"ETag": NOT_AN_MD5, "x-amz-server-side-encryption": "aws:kms"},
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint_url)  # the CLI's store too
    monkeypatch.setenv("SHARDCACHE_DIR", str(tmp_path / "cache"))
    cache = ShardCache()
    for key in ("crc.tar", "old.tar", "kms.tar", "mp.tar"):
        cache.fetch(f"s3://{BUCKET}/{key}")
    old = cache.path_for(f"s3://{BUCKET}/old.tar")
    record = read_meta(cache.layout, old)
    assert record.pop("verified") == "md5"
    write_meta(cache.layout, old, record)

    def run(*args: str) -> dict[str, Any]:
        main([*args, "--json"])
        return json.loads(capsys.readouterr().out)

    assert run("status")["verified"] == {"crc32": 1, "md5-parts": 1, "size": 1, "unknown": 1}
    assert main(["status"]) == 0
    text = capsys.readouterr().out
    assert "verified    crc32 1, md5-parts 1, size 1, unknown 1" in text
    assert "size: checked by their size only" in text
    assert run("status", "--all")["scopes"][0]["verified"]["unknown"] == 1

    checked = run("verify")
    assert checked["counts"]["ok"] == 4
    assert checked["verified"] == {"crc32": 1, "md5": 1, "md5-parts": 1, "size": 1}
    assert main(["verify"]) == 0
    assert "checked by: crc32 1, md5 1, md5-parts 1, size 1" in capsys.readouterr().out
    quick = run("verify", "--quick")
    assert quick["verified"] == {"size": 4}


def test_verify_command_exit_codes(s3, cached, tmp_path: Path) -> None:
    cache, shards = cached
    _flip_a_byte(cache.path_for(next(iter(shards))))
    env = {**os.environ, "SHARDCACHE_DIR": str(tmp_path / "cache")}

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shardcache", "verify"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    first = run()
    assert first.returncode == 1, first.stderr
    assert "4 shards, 3 ok, 1 bad" in first.stdout
    assert f"bad: {next(iter(shards))}: crc32 " in first.stdout and "; removed" in first.stdout
    second = run()
    assert second.returncode == 0, second.stderr
    assert "3 shards, 3 ok, 0 bad" in second.stdout


def test_a_lease_of_another_host_is_stale_only_when_old(tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache")
    leases = {}
    for name, hours in (("fresh", 0), ("old", 25)):
        url = f"s3://b/{name}.tar"
        lease = _lock_path(cache, url).with_suffix(".lease")
        lease.parent.mkdir(parents=True, exist_ok=True)
        lease.write_text(json.dumps({"host": "elsewhere", "pid": 1, "url": url, "seq": 3}))
        then = lease.stat().st_mtime - hours * 3600
        os.utime(lease, (then, then))
        leases[name] = lease
    report = status(cache)
    assert [i.path for i in report.stale_locks] == [leases["old"]]
    [held] = report.locks_held
    assert (held.path, held.mode, held.verdict) == (leases["fresh"], "lease", "unknown")
    assert [i.path for i in clean(cache).removed] == [leases["old"]]
    assert leases["fresh"].exists()


def test_a_lease_renewed_since_it_was_judged_is_not_removed(tmp_path: Path) -> None:
    lease = tmp_path / "abc.lease"
    lease.write_bytes(b'{"seq": 2}')
    fs = SafeFS(tmp_path, Trust.private())
    assert not remove_lease_if_unchanged(fs, lease, b'{"seq": 1}')
    assert lease.read_bytes() == b'{"seq": 2}'
    assert [p.name for p in tmp_path.iterdir()] == ["abc.lease"]  # nothing left aside
    assert remove_lease_if_unchanged(fs, lease, b'{"seq": 2}')
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: drops its own capabilities with setpriv")
def test_status_and_verify_report_directories_they_cannot_read(tmp_path: Path) -> None:
    """Run as a process without CAP_DAC_OVERRIDE (root that dropped its capabilities), a
    mode-000 bucket directory really cannot be listed: status and verify name it."""
    src = tmp_path / "src"
    src.mkdir()
    cache = ShardCache(tmp_path / "cache", scope="node")
    for i in range(6):
        (src / f"s{i}.tar").write_bytes(os.urandom(1000))
        cache.fetch(str(src / f"s{i}.tar"))
    hidden = cache.path_for(str(src / "s0.tar")).parent
    os.chmod(hidden, 0)
    try:

        def run(command: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [
                    *("setpriv", "--bounding-set=-all", "--inh-caps=-all", "--", sys.executable),
                    *("-m", "shardcache", command, "--json"),
                    *("--cache-dir", str(tmp_path / "cache"), "--scope", "node"),
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )

        state, checked = run("status"), run("verify")
    finally:
        os.chmod(hidden, 0o755)
    assert state.returncode == 0, state.stderr
    unreadable = json.loads(state.stdout)["unreadable"]
    assert [u["path"] for u in unreadable] == [str(hidden)]
    assert "EACCES" in unreadable[0]["error"]
    assert checked.returncode == 1, "verify cannot vouch for a directory it could not read"
    assert [u["path"] for u in json.loads(checked.stdout)["unreadable"]] == [str(hidden)]


def test_sample_records_go_with_their_shard(tmp_path: Path) -> None:
    """The sample offsets learned of a cached shard (``.samples/``) are removed with it by
    eviction; one whose shard vanished behind the cache's back is an orphan for ``clean``,
    and one of a shard still cached is kept."""
    from shardcache._datasets.sample_index import cached_samples
    from shardcache._ops.demo import make_shard

    sources = []
    for i in range(3):
        source = tmp_path / "data" / f"shard-{i}.tar"
        source.parent.mkdir(exist_ok=True)
        source.write_bytes(make_shard(i, 4))
        sources.append(str(source))
    cache = ShardCache(tmp_path / "cache")
    assert [cached_samples(cache, url).count for url in sources] == [4, 4, 4]
    finals = [cache.path_for(url) for url in sources]
    records = [cache.layout.samples_record_path(final) for final in finals]
    assert all(record.exists() for record in records)

    assert cache.remove(finals[0])  # eviction's removal: the record goes with the shard
    assert not records[0].exists()
    finals[1].unlink()  # gone behind the cache's back: its records are orphans
    report = status(cache)
    assert {(i.path, i.kind) for i in report.orphans} == {
        (cache.layout.meta_path(finals[1]), "meta"),
        (records[1], "samples"),
    }
    assert "orphan sample record" in report.format()
    cleaned = clean(cache)
    assert {i.path for i in cleaned.removed} == {cache.layout.meta_path(finals[1]), records[1]}
    assert not records[1].exists() and records[2].exists()
    assert status(cache).orphans == []


def test_status_of_a_cache_that_is_not_there_says_what_is(tmp_path: Path, capsys) -> None:
    from shardcache._cli.main import main

    root = tmp_path / "cache"

    def run(*args: str) -> tuple[int, str, str]:
        code = main([*args, "--cache-dir", str(root)])
        out, err = capsys.readouterr()
        return code, out, err

    for command in (
        ["status"],
        ["status", "--json"],
        ["clean"],
        ["verify"],
        ["evict", "--max-bytes", "1G"],
    ):
        code, out, err = run(*command)
        assert (code, out) == (1, ""), err
        assert err == (
            f"shardcache: CacheDirError: no cache at {root}/rank-0: {root} does not exist "
            "(cache root from argument, rank scope from default); check --cache-dir / "
            "SHARDCACHE_DIR, or warm it first\n"
        )
    root.write_text("not a directory")
    code, out, err = run("status")
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        f"shardcache: CacheDirError: {root} is not a directory (a regular file); expected the "
        "cache root SHARDCACHE_DIR / --cache-dir names, holding rank-N and node directories: "
        "give the right --cache-dir"
    ]
    root.unlink()

    # A node-scope job's cache, looked at with the default rank scope.
    source = tmp_path / "a.tar"
    source.write_bytes(b"x" * 1000)
    ShardCache(root, scope="node").fetch(str(source))
    code, out, err = run("status")
    assert (code, out) == (1, "")
    assert err.endswith(
        "the cache root holds node: pick one with --scope node or --rank N, or give --all\n"
    )
    code, out, err = run("status", "--scope", "node")
    assert code == 0 and "entries     1 shards, 1.0 KB" in out
    (root / "rank-0").mkdir()
    code, out, err = run("status")
    assert code == 0, err
    assert out.splitlines()[1].startswith("also here   node (other scopes of ")
    assert "entries     0 shards" in out and " free of 0 B" not in out
    shown = json.loads(run("status", "--json")[1])
    assert shown["other_scopes"] == ["node"] and shown["disk_total"] > 0
