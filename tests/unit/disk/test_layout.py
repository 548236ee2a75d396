"""layout: URL -> cache paths (never escaping the scope), temp names, race-free mkdir."""

from __future__ import annotations

import errno
import hashlib
import multiprocessing
import os
import pickle
import random
import stat
from pathlib import Path
from typing import Any

import pytest

from shardcache._base.dirs import LOCAL_PATIENCE, dir_error, ensure_dir
from shardcache._base.errors import CacheDirError, ConfigError
from shardcache._disk.layout import (
    LEASE_STEPS,
    CacheLayout,
    TempName,
    cache_key,
    host_tag,
    is_temp_name,
    lease_path,
    lease_step_of,
    lease_step_path,
    meta_temp_path,
    meta_temp_pid,
    namespace,
    owner_path,
    parse_temp_name,
    scope_dir,
)

HOSTILE_URLS = [
    "s3://b/../../etc/passwd",
    "s3://b/..",
    "s3://b/.",
    "s3://b//abs",
    "s3:///etc/passwd",
    "file:///etc/passwd",
    "/etc/passwd",
    "../../../../etc/passwd",
    "..",
    ".",
    "/",
    "",
    "s3://b/",
    "s3://b/dir/",
    "s3://b/dir//",
    "s3://",
    "s3://b/" + "a" * 1024,
    "s3://b/" + "a" * 1024 + ".tar",
    "s3://b/x." + "e" * 300,
    "s3://b/%2e%2e/%2e%2e/x.tar",
    "s3://b/%2e%2e",
    "s3://b/..%2f..%2fetc%2fpasswd",
    "s3://b/a\\..\\..\\windows.tar",
    "s3://b/tab\there.tar",
    "s3://b/ctrl\x01\x02\x1b[31m.tar",
    "s3://b/\x7fdel.tar",
    "s3://b/ünïcödé-шард-数据.tar",
    "s3://b/\u202eevil\u202d.tar",
    "s3://b/emoji-\U0001f4a5.tar.gz",
    "s3://b/shard.tar?versionId=1",
    "s3://b/shard.tar?versionId=2",
    "s3://b/shard.tar#frag",
    "s3://b/q?x=../../etc/passwd",
    "s3://b/.hidden",
    "s3://b/...tar",
    "s3://b/-rf",
    "s3://b/train.000123.tar",
    "s3://b/x.tar.gz",
    "s3://b/x.TAR.ZST",
    "http://host:9000/b/key.tar",
    "s3://b/" + "é" * 400,
    "s3://b/" + "/" * 50,
    "s3://b/a b c.tar",
    "s3://b/lone-\udcff-surrogate.tar",
]


def _random_urls(count: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    alphabet = "ab./%?#-_ \\\t\x01~éш\u202e\U0001f4a5{}:"
    urls = []
    for _ in range(count):
        prefix = rng.choice(["s3://b/", "file://", "/", "", "gs://x/y/", "https://h/"])
        body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        urls.append(prefix + body)
    return urls


def _assert_inside(path: Path, parent: Path) -> None:
    # Structure: parent/<hh>/<name>, with a single safe name component.
    assert path.parent.parent == parent, path
    assert len(path.parent.name) == 2
    name = path.name
    assert name not in {"", ".", ".."}
    assert "/" not in name and "\x00" not in name
    assert len(name.encode("utf-8")) <= 255
    normal = os.path.normpath(path)
    assert normal.startswith(str(parent) + os.sep), normal


def _shard(layout: CacheLayout, url: str, namespace: str = "") -> Path:
    """The data path of ``url`` taken as already canonical (no local-path rewriting)."""
    return layout.identify(url, "s3", namespace).data_path


def _lock(layout: CacheLayout, url: str, namespace: str = "") -> Path:
    return layout.identify(url, "s3", namespace).lock_path


@pytest.mark.parametrize("namespace", ["", "s3@http://127.0.0.1:9000"])
def test_hostile_urls_stay_inside_scope(tmp_path: Path, namespace: str) -> None:
    layout = CacheLayout(tmp_path / "scope")
    urls = HOSTILE_URLS + _random_urls(2000)
    urls = list(dict.fromkeys(urls))  # distinct inputs only
    data_paths, lock_paths = set(), set()
    for url in urls:
        data = _shard(layout, url, namespace)
        lock = _lock(layout, url, namespace)
        temp = layout.temp_path(data)
        _assert_inside(data, layout.data_dir)
        _assert_inside(lock, layout.locks_dir)
        _assert_inside(temp, layout.data_dir)
        assert temp.parent == data.parent
        assert is_temp_name(temp.name)
        assert not is_temp_name(data.name)
        assert data.name[0] not in ".-"
        data_paths.add(data)
        lock_paths.add(lock)
    assert len(data_paths) == len(urls)
    assert len(lock_paths) == len(urls)


def test_hostile_names_are_creatable(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path / "scope")
    for url in HOSTILE_URLS:
        data = _shard(layout, url)
        ensure_dir(data.parent)
        temp = layout.temp_path(data)
        temp.write_bytes(b"x")
        os.replace(temp, data)
        lock = _lock(layout, url)
        ensure_dir(lock.parent)
        lock.touch()
    created = [p for p in (tmp_path / "scope").rglob("*") if p.is_file()]
    assert len(created) == 2 * len(HOSTILE_URLS)
    assert all(str(p).startswith(str(tmp_path / "scope")) for p in created)


def test_data_path_shape() -> None:
    layout = CacheLayout(Path("/cache/node"))
    url = "s3://bucket/train-000123.tar"
    key = cache_key(url)
    path = _shard(layout, url)
    assert path == Path(f"/cache/node/data/{key[:2]}/train-000123-{key[:20]}.tar")
    assert _lock(layout, url) == Path(f"/cache/node/.locks/{key[:2]}/{key}.lock")
    assert _shard(layout, "s3://b/x.tar.gz").name.endswith(".tar.gz")
    assert _shard(layout, "s3://b/train.000123.tar").name.startswith("train.000123-")
    long_ext = "s3://b/x." + "e" * 40  # extension too long to be a suffix: stays in the stem
    assert _shard(layout, long_ext).name == "x." + "e" * 40 + "-" + cache_key(long_ext)[:20]
    assert _shard(layout, "s3://b/shard.tar?versionId=1").name.startswith("shard-")
    # '?' and '#' are ordinary characters in local names.
    assert _shard(layout, "/d/a#b.tar").name.startswith("a_b-")
    long_stem = _shard(layout, "s3://b/" + "a" * 1024 + ".tar").name
    assert long_stem == "a" * 64 + "-" + cache_key("s3://b/" + "a" * 1024 + ".tar")[:20] + ".tar"
    assert _shard(layout, "s3://b/").name.startswith("b-")
    assert _shard(layout, "s3://b/..").name.startswith("shard-")
    assert layout.data_dir == Path("/cache/node/data")
    assert layout.locks_dir == Path("/cache/node/.locks")


def test_cache_key_namespaces() -> None:
    url = "s3://b/k.tar"
    assert cache_key(url) == hashlib.sha256(b"\ns3://b/k.tar").hexdigest()
    assert cache_key(url, "s3@http://a:9000") != cache_key(url, "s3@http://b:9000")
    layout = CacheLayout(Path("/c"))
    assert _shard(layout, url, "ep1") != _shard(layout, url, "ep2")
    with pytest.raises(ConfigError):
        cache_key(url, "bad\nnamespace")


def test_one_stores_schemes_are_one_cache_entry_and_its_endpoint_or_account_is_kept() -> None:
    layout = CacheLayout(Path("/c"))

    def identity(url: str, options: dict[str, Any]) -> Any:
        protocol = url.split("://", maxsplit=1)[0]
        return layout.identify(url, protocol, namespace(protocol, options))

    azure = {"connection_string": "AccountName=acct;AccountKey=k;BlobEndpoint=http://h/acct;"}
    az = identity("az://ctr/d/a.tar", azure)
    assert (
        identity("abfs://ctr/d/a.tar", azure).data_path
        == identity("abfss://ctr/d/a.tar", azure).data_path
    )
    assert identity("abfs://ctr/d/a.tar", azure).data_path == az.data_path
    assert az.canonical_url == "az://ctr/d/a.tar"
    assert az.namespace == "az@http://h/acct"  # never the key
    assert identity("az://ctr/d/a.tar", {"account_name": "other"}).data_path != az.data_path
    gs = identity("gs://b/a.tar", {})
    assert identity("gcs://b/a.tar", {}).data_path == gs.data_path
    assert identity("gs://b/a.tar", {"endpoint_url": "http://127.0.0.1:1"}).namespace == (
        "gs@http://127.0.0.1:1"
    )


def test_temp_name_round_trip(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path)
    for url in HOSTILE_URLS:
        final = _shard(layout, url)
        temp = layout.temp_path(final)
        parsed = parse_temp_name(temp.name)
        assert parsed is not None
        assert parsed.final == final.name
        assert parsed.host == host_tag()
        assert parsed.pid == os.getpid()
        assert len(parsed.token) >= 8
        assert parsed.token in temp.name
    final = tmp_path / "x-0123.tar.gz"
    temp = CacheLayout.temp_path(final, token="deadbeef")
    assert temp == tmp_path / f".x-0123.tar.gz.{host_tag()}.{os.getpid()}.deadbeef.part"
    assert parse_temp_name(temp.name) == TempName(
        "x-0123.tar.gz", host_tag(), os.getpid(), "deadbeef"
    )
    assert CacheLayout.temp_path(final) != CacheLayout.temp_path(final)  # random tokens
    with pytest.raises(ValueError):
        CacheLayout.temp_path(final, token="a.b")


@pytest.mark.parametrize(
    "name",
    ["x.tar", ".x.tar", "x.part", ".x.part", ".x.host.part", ".x.host.pid.tok.part", ""],
)
def test_not_temp_names(name: str) -> None:
    assert parse_temp_name(name) is None
    assert not is_temp_name(name)


def test_side_file_names_round_trip(tmp_path: Path) -> None:
    """Every name a writer makes is recognised by ``clean`` (one module names and parses)."""
    layout = CacheLayout(tmp_path / "scope")
    shard = layout.identify("s3://b/train-000001.tar", "s3", "")
    temp = meta_temp_path(shard.meta_path)
    assert temp.parent == shard.meta_path.parent
    assert meta_temp_pid(temp.name) == os.getpid()
    assert meta_temp_pid(shard.meta_path.name) is None
    assert owner_path(shard.lock_path).name.endswith(".owner")
    lease = lease_path(shard.lock_path)
    for step in LEASE_STEPS:
        aside = lease_step_path(lease, "tok", step)
        assert aside.parent == lease.parent and lease_step_of(aside.name) == step
    for name in (lease.name, shard.lock_path.name, "claim", temp.name):
        assert lease_step_of(name) is None, name


def test_host_tag_is_filename_safe() -> None:
    tag = host_tag()
    assert tag and "." not in tag and "/" not in tag


def test_scope_dir() -> None:
    root = Path("/cache")
    assert scope_dir(root, "rank", 3) == Path("/cache/rank-3")
    assert scope_dir(root, "node", 3) == Path("/cache/node")
    with pytest.raises(ConfigError, match="SHARDCACHE_SCOPE"):
        scope_dir(root, "job", 0)
    with pytest.raises(ConfigError):
        scope_dir(root, "rank", -1)


# ------------------------------------------------------------------------- ensure_dir


def test_ensure_dir_creates_and_is_idempotent(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b" / "c"
    assert ensure_dir(target) == target
    assert target.is_dir()
    assert ensure_dir(target) == target
    assert ensure_dir(str(target)) == target


def test_ensure_dir_never_world_writable(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ensure_dir(tmp_path / "x" / "y", mode=0o777)
    finally:
        os.umask(old)
    for path in (tmp_path / "x", tmp_path / "x" / "y"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o002 == 0


def _race_worker(target: str, barrier: Any, results: Any, index: int) -> None:
    try:
        barrier.wait(timeout=30)
        ensure_dir(target)
        ensure_dir(Path(target).parent / f"sibling-{index}" / "leaf")
        results.put((index, "ok"))
    except BaseException as exc:
        results.put((index, f"{type(exc).__name__}: {exc}"))


def test_ensure_dir_many_processes_at_once(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    target = tmp_path / "d1" / "d2" / "d3" / "d4" / "d5" / "d6" / "d7" / "d8"
    barrier = ctx.Barrier(8)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_race_worker, args=(str(target), barrier, results, i)) for i in range(8)
    ]
    for proc in procs:
        proc.start()
    outcomes = dict(results.get(timeout=60) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert outcomes == {i: "ok" for i in range(8)}
    assert target.is_dir()
    assert all((target.parent / f"sibling-{i}" / "leaf").is_dir() for i in range(8))


def test_ensure_dir_file_in_the_way(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(CacheDirError) as info:
        ensure_dir(blocker)
    message = str(info.value)
    assert f"a regular file exists at {blocker}" in message
    assert "SHARDCACHE_DIR" in message
    assert info.value.path == str(blocker)

    with pytest.raises(CacheDirError) as info:
        ensure_dir(blocker / "sub" / "dir")
    assert f"a regular file exists at {blocker}" in str(info.value)
    assert info.value.errno == errno.ENOTDIR


def test_ensure_dir_dangling_symlink_fails_fast(tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(CacheDirError) as info:
        ensure_dir(link / "sub", timeout=30)
    seen = f"a dangling symbolic link (to {tmp_path / 'nowhere'}, which does not exist) exists at"
    assert f"{seen} {link}." in str(info.value)


def test_ensure_dir_through_symlink_to_dir(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    assert ensure_dir(tmp_path / "link" / "a").is_dir()
    assert (tmp_path / "real" / "a").is_dir()


def test_ensure_dir_retries_transient_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_mkdir = os.mkdir
    failures = iter([errno.ESTALE, errno.ENOENT, errno.EIO])

    def flaky_mkdir(path: Any, mode: int = 0o777, **kwargs: Any) -> None:
        code = next(failures, None)
        if code is not None:
            raise OSError(code, os.strerror(code), os.fspath(path))
        real_mkdir(path, mode, **kwargs)

    monkeypatch.setattr(os, "mkdir", flaky_mkdir)
    target = tmp_path / "p" / "q"
    assert ensure_dir(target, timeout=10) == target
    assert target.is_dir()


def test_ensure_dir_gives_up_at_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def stale(path: Any, mode: int = 0o777, **kwargs: Any) -> None:
        raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), os.fspath(path))

    monkeypatch.setattr(os, "mkdir", stale)
    with pytest.raises(CacheDirError) as info:
        ensure_dir(tmp_path / "never", timeout=30)
    # tmp_path is on a local file system: "not yet" is retried for LOCAL_PATIENCE (1 s),
    # not 30 s. Counted in tries of a backoff that doubles from 5 ms to 1 s: about 10 in
    # 1 s, over 25 in 30 s; a slower machine makes fewer, never more.
    assert LOCAL_PATIENCE == 1.0
    exc = info.value
    assert 2 <= exc.attempts < 20, exc
    assert "NFS" not in str(exc) and "is local" in str(exc)
    assert str(tmp_path / "never") in str(exc)
    assert exc.errno == errno.ESTALE


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.EROFS, ["read-only file system"]),
        (errno.EACCES, ["permission denied creating", "owned by uid", "mode 0o"]),
        (errno.ENOSPC, ["no space"]),
        (errno.ENAMETOOLONG, ["too long"]),
    ],
)
def test_ensure_dir_error_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, words: list[str]
) -> None:
    def failing(path: Any, mode: int = 0o777, **kwargs: Any) -> None:
        raise OSError(code, os.strerror(code), os.fspath(path))

    monkeypatch.setattr(os, "mkdir", failing)
    target = tmp_path / "x"
    with pytest.raises(CacheDirError) as info:
        ensure_dir(target)
    exc = info.value
    message = str(exc)
    for word in words:
        assert word in message
    assert str(target) in message
    assert "a writable directory" in message and "SHARDCACHE_DIR" in message
    assert exc.errno == code
    clone = pickle.loads(pickle.dumps(exc))
    assert str(clone) == message and clone.errno == code and clone.path == str(target)


@pytest.mark.skipif(
    os.geteuid() == 0,
    reason="needs a non-root user: root bypasses directory permissions (as root, "
    "tests/system/torture/test_hostile.py::test_cache_dir_problems_are_clear_errors drops "
    "CAP_DAC_OVERRIDE for this case)",
)
def test_ensure_dir_read_only_parent(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        with pytest.raises(CacheDirError, match="permission denied"):
            ensure_dir(parent / "child")
    finally:
        parent.chmod(0o755)


# ------------------------------------------------------------------------- dir_error


@pytest.mark.parametrize(
    ("code", "word"),
    [(errno.EROFS, "read-only"), (errno.EACCES, "permission denied"), (errno.ENOSPC, "no space")],
)
def test_dir_error_says_what_was_seen(tmp_path: Path, code: int, word: str) -> None:
    exc = OSError(code, os.strerror(code), str(tmp_path / "probe"))
    error = dir_error(tmp_path, exc, "creating a file in")
    assert isinstance(error, CacheDirError) and error.errno == code
    assert word in str(error) and str(tmp_path) in str(error) and "SHARDCACHE_DIR" in str(error)
