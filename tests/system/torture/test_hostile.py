"""Hostile and bad input: each gives a specific error, and nothing outside the cache root
is touched (the parent tree is snapshotted before and compared after)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardcache import (
    CacheDirError,
    CacheFullError,
    ConfigError,
    ShardCache,
    ShardCacheError,
    UrlError,
    expand_urls,
)
from shardcache._base.process_identity import ProcessIdentity
from shardcache._config.settings import SPECS, Settings
from shardcache._ops import verify


def _snapshot(root: Path, skip: Path | None = None) -> dict[str, tuple]:
    """Every path under ``root`` (except ``skip``) with its type, size and content hash."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        if skip is not None and (here == skip or skip in here.parents):
            dirnames[:] = []
            continue
        for name in dirnames + filenames:
            p = here / name
            if p == skip:
                continue
            st = os.lstat(p)
            digest = ""
            if p.is_file() and not p.is_symlink():
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p)] = (st.st_mode, st.st_size, digest)
    return out


@pytest.fixture
def source(tmp_path: Path) -> tuple[str, bytes]:
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(50_000)
    (src / "train-000000.tar").write_bytes(data)
    return str(src / "train-000000.tar"), data


# ------------------------------------------------------------------------ URL specs

BAD_SPECS = {
    "unbalanced brace": ("s3://b/train-{000..009.tar", "brace"),
    "stray close brace": ("s3://b/train-000..009}.tar", "brace"),
    "not a range or list": ("s3://b/train-{abc}.tar", "brace"),
    "empty list": ([], "Empty"),
    "empty string": ("", "Empty"),
    "unknown protocol": ("s4://b/train.tar", "protocol"),
    "broken scheme": ("s3:/b/train.tar", "scheme"),
    "NUL": ("s3://b/tr\x00ain.tar", "NUL"),
    "newline": ("s3://b/train\n.tar", "newline"),
    "carriage return": ("s3://b/train\r.tar", "carriage return"),
    "9 KB URL": ("s3://b/" + "x" * 9000, "too long"),
    "huge range": ("s3://b/{0..99999999999}.tar", "too large"),
    "protocol chaining": ("simplecache::s3://b/x.tar", "chaining"),
}


def test_bad_url_specs_raise_url_error_naming_the_problem(figures) -> None:
    for case, (spec, word) in BAD_SPECS.items():
        with pytest.raises(UrlError) as info:
            expand_urls(spec)
        msg = str(info.value)
        assert word.lower() in msg.lower(), (case, msg)
        assert "Expected" in msg and info.value.hint, (case, msg)
    figures.add(
        "bad input",
        "URL specs: " + ", ".join(BAD_SPECS),
        len(BAD_SPECS),
        "UrlError naming the spec, what was expected, what was seen and a hint, every time",
    )


HOSTILE_KEYS = [
    "../../../../etc/passwd",
    "a/../../b.tar",
    "/abs/path.tar",
    "..",
    ".",
    "uni-\u00e9\u4e2d\U0001f600.tar",
    "\u202etxt.exe",
    "x" * 1000 + ".tar",
    "a" * 255 + "/" + "b" * 255,
    "sp ace & quote'\".tar",
    "-leading-dash.tar",
    ".hidden.tar",
    "trailing/",
]


def test_hostile_keys_are_cached_inside_the_root_or_refused(tmp_path: Path, figures) -> None:
    """Local sources named by hostile keys, fetched as file paths: the cached copy is always
    inside the scope, and nothing outside the cache root changes."""
    src = tmp_path / "src"
    src.mkdir()
    cache_root = tmp_path / "cache"
    cache = ShardCache(cache_root, scope="node")
    ok = refused = 0
    for key in HOSTILE_KEYS:
        url = f"s3://bucket/{key}"
        path = cache.path_for(url)
        assert cache.settings.scope_dir in path.parents, (key, path)
        assert len(path.name.encode()) < 255
    before = _snapshot(tmp_path, skip=cache_root)
    for i, key in enumerate(HOSTILE_KEYS):
        # A local file whose *path* carries the hostile part (where the OS allows it).
        target = src / f"k{i}" / key.lstrip("/")
        if Path(os.path.normpath(target)).parent != target.parent and not str(
            os.path.normpath(target)
        ).startswith(str(src / f"k{i}")):
            # '..' keys: the source itself would live outside the test directory; fetch the
            # unnormalised path of a file that exists inside it instead.
            target = src / f"k{i}" / "x" / "y" / "z" / "w" / key
            if not str(os.path.normpath(target)).startswith(str(src)):
                continue
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(key.encode())
        except OSError:
            continue
        before = _snapshot(tmp_path, skip=cache_root)
        url = str(target)
        try:
            got = cache.fetch(url)
        except ShardCacheError as exc:
            refused += 1
            assert url[:50] in str(exc) or str(target)[:50] in str(exc), str(exc)
        else:
            ok += 1
            assert cache.settings.scope_dir in got.parents
            assert got.read_bytes() == target.read_bytes()
        assert _snapshot(tmp_path, skip=cache_root) == before, key
    figures.add(
        "bad input",
        "hostile keys: '..', absolute, unicode/RTL, 1 KB names, quotes, dash/dot prefixes",
        len(HOSTILE_KEYS),
        f"path always inside the scope; {ok} cached correctly, {refused} refused with a "
        "specific error; nothing outside the cache root touched",
    )


# ------------------------------------------------------------------------ environment

GARBAGE = ["garbage", "-1", "0", "1e400", "99999999999999999999999P", "", " ", "nan", "\u00e9"]


def test_every_variable_with_garbage_is_rejected_or_safe(tmp_path: Path, source, figures) -> None:
    url, data = source
    rejected = accepted = 0
    for name, spec in SPECS.items():
        for index, value in enumerate(GARBAGE):
            env = {spec.env: value, "SHARDCACHE_DIR": str(tmp_path / "c")}
            if spec.env == "SHARDCACHE_DIR":
                env[spec.env] = value
            try:
                settings = Settings.resolve(env=env)
            except ConfigError as exc:
                rejected += 1
                msg = str(exc)
                assert spec.env in msg and "expected" in msg.lower(), msg
                # Unparsable storage options may hold credentials, and the mesh secret is
                # one: never echoed.
                credential = spec.env == "SHARDCACHE_MESH_SECRET" or (
                    spec.env == "SHARDCACHE_STORAGE_OPTIONS" and "not valid JSON" in msg
                )
                shown = not credential
                assert repr(value) in msg or value.strip() == "" or not shown, msg
                continue
            accepted += 1
            got = getattr(settings, name)
            if spec.low is not None:
                assert spec.low <= got <= spec.high, (name, value, got)
            if name == "cache_dir":
                # A relative SHARDCACHE_DIR is taken as given; it must still be a usable
                # path (it is resolved against the working directory).
                assert "\x00" not in str(got)
                continue
            # An accepted value must give a cache that works (a directory of its own: a
            # shared group's cache is not a private one's).
            root = tmp_path / f"ok-{name}-{index}"
            cache = ShardCache(settings=settings.replace(cache_dir=root))
            assert cache.fetch(url).read_bytes() == data, (name, value)
    figures.add(
        "bad input",
        f"every SHARDCACHE_* variable ({len(SPECS)}) x {len(GARBAGE)} values: garbage, "
        "negative, zero, huge, empty, nan, unicode",
        len(SPECS) * len(GARBAGE),
        f"{rejected} rejected with ConfigError naming variable, value and accepted form; "
        f"{accepted} accepted as a meaningful value (0 = unlimited/none where documented) and "
        "a fetch with it works",
    )


# ------------------------------------------------------------------------ cache directory


def test_cache_dir_problems_are_clear_errors(tmp_path: Path, source, figures) -> None:
    url, data = source
    outcomes = []
    # Missing parent: created.
    deep = tmp_path / "no" / "such" / "parent"
    assert ShardCache(deep).fetch(url).read_bytes() == data
    outcomes.append("missing parent: created")
    # A file where the directory should be.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CacheDirError) as info:
        ShardCache(blocker).fetch(url)
    assert str(blocker) in str(info.value) and "SHARDCACHE_DIR" in str(info.value)
    assert blocker.read_text() == "x"
    outcomes.append("a file: CacheDirError")
    # A dangling symlink as the root.
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(CacheDirError) as info:
        ShardCache(dangling).fetch(url)
    assert f"a dangling symbolic link (to {tmp_path / 'nowhere'}" in str(info.value)
    assert not (tmp_path / "nowhere").exists()
    outcomes.append("dangling symlink: CacheDirError")
    # Another user's directory: refused before anything is written in it.
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o755)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)
    else:
        foreign.chmod(0o775)
    with pytest.raises(CacheDirError, match="Refusing to use") as info:
        ShardCache(foreign).fetch(url)
    assert str(foreign) in str(info.value) and "SHARDCACHE_DIR" in str(info.value)
    assert not list(foreign.iterdir())
    outcomes.append("another user's (or group-writable): CacheDirError")
    # Not writable. As root (which writes anywhere), a child process without
    # CAP_DAC_OVERRIDE; as any other user, a 0555 directory.
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    drop_caps = []
    if os.geteuid() == 0:
        drop_caps = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search"]
    code = (
        "import sys\nfrom shardcache import ShardCache, CacheDirError\n"
        f"try:\n    ShardCache({str(locked)!r}).fetch({url!r})\n"
        "except CacheDirError as exc:\n    print(exc); sys.exit(7)\n"
    )
    proc = subprocess.run(
        [*drop_caps, sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 7, (proc.stdout, proc.stderr)
    assert str(locked) in proc.stdout and "permission denied" in proc.stdout.lower()
    assert not list(locked.iterdir())
    outcomes.append("not writable (as root: no CAP_DAC_OVERRIDE): CacheDirError")
    figures.add("bad input", "cache dir: " + "; ".join(outcomes), len(outcomes), "as listed")


@pytest.fixture
def tmpfs(tmp_path: Path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(mnt)],
        check=True,
        timeout=30,
    )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


@pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: mounts a 256 KiB tmpfs and remounts it read-only"
)
def test_disk_full_and_read_only_file_system(tmp_path: Path, tmpfs: Path, figures) -> None:
    src = tmp_path / "src"
    src.mkdir()
    small, big = os.urandom(60_000), os.urandom(400_000)
    (src / "small.tar").write_bytes(small)
    (src / "big.tar").write_bytes(big)
    (src / "other.tar").write_bytes(small[::-1])
    cache = ShardCache(tmpfs / "cache")
    assert cache.fetch(str(src / "small.tar")).read_bytes() == small
    with pytest.raises(CacheFullError) as info:
        cache.fetch(str(src / "big.tar"))
    assert "big.tar" in str(info.value) and "SHARDCACHE_DIR" in str(info.value)
    assert not list(tmpfs.rglob("*.part"))
    assert cache.fetch(str(src / "small.tar")).read_bytes() == small  # still served
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True, timeout=30)
    before = _snapshot(tmpfs)
    assert cache.fetch(str(src / "small.tar")).read_bytes() == small  # hits work read-only
    with pytest.raises(ShardCacheError) as ro:
        cache.fetch(str(src / "other.tar"))
    msg = str(ro.value)
    assert "read-only" in msg.lower() and str(tmpfs) in msg, msg
    assert _snapshot(tmpfs) == before
    figures.add(
        "bad input",
        "disk full (256 KiB tmpfs, 400 kB shard); read-only remount of the cache file system",
        2,
        f"CacheFullError with the numbers, nothing partial left; cached shards still served "
        f"read-only, a miss gives {type(ro.value).__name__} saying 'read-only file system'",
    )


# ------------------------------------------------------------------------ symlink swaps


@pytest.mark.parametrize("where", ["data", "data-bucket", "meta-bucket", "locks-bucket", "final"])
def test_symlink_swaps_never_write_outside_the_root(
    tmp_path: Path, source, where: str, figures
) -> None:
    url, data = source
    cache_root = tmp_path / "cache"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"precious")
    cache = ShardCache(cache_root, scope="node")
    final = cache.path_for(url)
    lock = cache._identify(url).lock_path
    meta = cache.layout.meta_path(final)
    swap = {
        "data": cache.layout.data_dir,
        "data-bucket": final.parent,
        "meta-bucket": meta.parent,
        "locks-bucket": lock.parent,
        "final": final,
    }[where]
    swap.parent.mkdir(parents=True, exist_ok=True)
    swap.symlink_to(outside / "victim" if where == "final" else outside)
    before = _snapshot(outside)
    try:
        got = cache.fetch(url)
    except ShardCacheError as exc:
        outcome = f"refused: {type(exc).__name__}"
        assert str(swap) in str(exc) or "symbolic link" in str(exc), str(exc)
    else:
        outcome = "fetched inside the root"
        assert got.read_bytes() == data and not got.is_symlink()
        assert outside not in got.resolve().parents
    assert _snapshot(outside) == before, f"{where}: wrote outside the cache root"
    figures.add("bad input", f"symlink swap of {where} to a directory outside", 1, outcome)


# ------------------------------------------------------------------------ altered shards


def test_altered_and_truncated_shards_are_detected_and_refetched(s3, tmp_path: Path, figures):
    blobs = {f"v-{i}.tar": os.urandom(30_000) for i in range(4)}
    s3.put_objects("verify", blobs)
    cache = ShardCache(tmp_path / "cache")
    urls = {f"s3://verify/{k}": v for k, v in blobs.items()}
    for u in urls:
        cache.fetch(u)
    altered, truncated = list(urls)[:2]
    with open(cache.path_for(altered), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\x00")
    with open(cache.path_for(truncated), "r+b") as f:
        f.truncate(1000)
    report = verify.verify(cache)
    bad = {i.url for i in report.of("bad")}
    assert bad == {altered, truncated} and all(i.removed for i in report.of("bad"))
    for u, v in urls.items():
        assert cache.fetch(u).read_bytes() == v
    figures.add(
        "bad input",
        "cached shard altered (2 bytes) / truncated behind our back",
        2,
        "both reported bad by verify (MD5, size) and removed; the next fetch re-downloads them",
    )


# ------------------------------------------------------------------------ lock files


@pytest.mark.parametrize("mode", ["flock", "lease"])
def test_bad_lock_files_are_handled(tmp_path: Path, source, mode: str, figures) -> None:
    url, data = source
    me = ProcessIdentity.current()
    init = ProcessIdentity.of(1) if hasattr(ProcessIdentity, "of") else None
    records = {
        "garbage": b"\x00\xff not json {{{",
        "empty": b"",
        "json list": b"[1, 2, 3]",
        "pid 1 of this host (alive, not ours)": json.dumps(
            {
                "host": me.host,
                "boot_id": me.boot_id,
                "pidns": me.pidns,
                "pid": 1,
                "start_ticks": getattr(init, "start_ticks", None),
                "since": 0,
            }
        ).encode(),
        "pid reused (wrong start time)": json.dumps(
            {"host": me.host, "boot_id": me.boot_id, "pidns": me.pidns, "pid": 1, "start_ticks": 1}
        ).encode(),
        "other host": json.dumps({"host": "elsewhere-" + socket.gethostname(), "pid": 5}).encode(),
    }
    results = []
    for label, raw in records.items():
        cache = ShardCache(
            tmp_path / label.replace(" ", "_"),
            scope="node",
            lock_mode=mode,
            lease_time=1.0,
            lock_timeout=30,
            lock_stuck_after=3600,
        )
        lock = cache._identify(url).lock_path
        lock.parent.mkdir(parents=True)
        target = lock.with_suffix(".lease" if mode == "lease" else ".owner")
        target.write_bytes(raw)
        if mode == "flock":
            lock.write_bytes(raw)  # the flock file's own content is irrelevant
        started = time.monotonic()
        # flock: nobody holds the kernel lock, so the record is irrelevant; lease: a record
        # that is never renewed is broken after lease_time (1 s), a dead pid at once. A
        # wait that relied on anything else would end in LockTimeout after 30 s (the
        # stuck-holder limit is an hour).
        assert cache.fetch(url).read_bytes() == data, label
        elapsed = time.monotonic() - started
        stats = cache.stats()
        assert (stats.misses, stats.errors) == (1, 0), (label, stats)
        with contextlib.suppress(FileNotFoundError):
            assert not target.exists() or mode == "flock"
        results.append(f"{label} {elapsed:.1f}s")
    figures.add(
        "bad input",
        f"{mode} lock files: " + ", ".join(records),
        len(records),
        "fetch succeeded every time (" + "; ".join(results) + ")",
    )
