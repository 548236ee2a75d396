"""pipe: URLs (webdataset's shell commands) through the cache, with real commands and processes.

Every command appends a line to a counter file before it does anything else, so the tests
count how often it really ran; a command that must be caught mid-run writes its shell's pid
(its process group's id) into a FIFO, which the test reads with a bounded wait.
"""

from __future__ import annotations

import json
import os
import select
import shlex
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import webdataset as wds
from processes import run_together

import shardcache
from shardcache import (
    CacheFullError,
    FetchError,
    PipeCommandError,
    ShardCache,
    UrlError,
    expand_urls,
)
from shardcache._base.url_kinds import url_protocol
from shardcache._cli.main import main
from shardcache._datasets.urls import read_manifest
from shardcache._disk.layout import is_temp_name
from shardcache._ops.demo import make_shard
from shardcache._ops.verify import verify
from shardcache._transfer.pipe_commands import STDERR_TAIL

pytestmark = pytest.mark.timeout(120)

BUCKET = "pipes"
SHARDS = 3
PER_SHARD = 4


# ----------------------------------------------------------------------------- helpers


@pytest.fixture
def shard_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "shards"
    directory.mkdir()
    for i in range(SHARDS):
        (directory / f"train-{i:06d}.tar").write_bytes(make_shard(i, PER_SHARD))
    return directory


class Counter:
    """A file each run of a command appends one line to."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def shell(self) -> str:
        return f"echo run >> {shlex.quote(str(self.path))}"

    def runs(self) -> int:
        return self.path.read_text().count("\n") if self.path.exists() else 0


@pytest.fixture
def counter(tmp_path: Path) -> Counter:
    return Counter(tmp_path / "runs.txt")


def _cache(tmp_path: Path, **settings: object) -> ShardCache:
    settings.setdefault("retry_backoff", 0.01)
    return ShardCache(tmp_path / "cache", **settings)


def _data_files(cache: ShardCache) -> list[Path]:
    data = cache.settings.scope_dir / "data"
    return sorted(p for p in data.rglob("*") if p.is_file()) if data.exists() else []


class PidChannel:
    """A FIFO a command writes its shell's pid to (``$$``: its process group's id)."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        # Read and write: never blocks the test, and never reads end-of-file between two
        # commands' writes (Linux allows O_RDWR on a FIFO).
        self._fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)
        self._buffer = b""

    @property
    def shell(self) -> str:
        return f"echo $$ > {shlex.quote(str(self.path))}"

    def next_pid(self, timeout: float = 30.0) -> int:
        """The next pid written, waiting at most ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._fd], [], [], max(0.0, left))
            assert ready, "the command never wrote its pid"
            self._buffer += os.read(self._fd, 64)
        line, self._buffer = self._buffer.split(b"\n", 1)
        return int(line)

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def pids(tmp_path: Path) -> Iterator[PidChannel]:
    channel = PidChannel(tmp_path / "pids.fifo")
    yield channel
    channel.close()


def _live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies (a zombie runs nothing)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp == pgid and state != "Z":
            alive.append(int(entry))
    return alive


def _members_after_their_exit(pgid: int, timeout: float = 10.0) -> list[int]:
    """:func:`_live_members` once each live member has exited (waited for on a pidfd, at
    most ``timeout`` in all): a SIGKILLed process takes a moment to exit on a busy
    machine, and the command's own children are not ours to reap."""
    deadline = time.monotonic() + timeout
    for pid in _live_members(pgid):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        finally:
            os.close(fd)
    return _live_members(pgid)


def _samples(spec: str, stage: object) -> list[tuple[str, str, bytes]]:
    pipeline = wds.DataPipeline(
        wds.SimpleShardList(spec), stage, wds.to_tuple("__key__", "cls", "npy")
    )
    return [(key, cls.decode(), npy) for key, cls, npy in pipeline]


# --------------------------------------------------------------------------------- URLs


def test_pipe_urls_are_commands_with_webdataset_brace_expansion() -> None:
    assert url_protocol("pipe:aws s3 cp s3://b/x.tar -") == "pipe"
    assert expand_urls("pipe:curl -s https://h/train-{000..002}.tar") == [
        f"pipe:curl -s https://h/train-00{i}.tar" for i in range(3)
    ]
    # Groups that are neither a range nor a list stay literal, as in webdataset; the
    # scheme-like text inside a command is no protocol, and nothing is a relative path.
    assert expand_urls("pipe:aws s3 cp s3://${BUCKET}/x-{0,1}.tar - | awk '{print}'") == [
        "pipe:aws s3 cp s3://${BUCKET}/x-0.tar - | awk '{print}'",
        "pipe:aws s3 cp s3://${BUCKET}/x-1.tar - | awk '{print}'",
    ]
    assert expand_urls(["pipe:cat a::b"]) == ["pipe:cat a", "b"]  # '::' separates specs
    for bad, problem in [
        ("pipe:", "Empty pipe command"),
        ("pipe:   ", "Empty pipe command"),
        ("pipe:cat x\nrm y", "Invalid character"),
        ("pipe:cat {a", "Unbalanced braces"),
    ]:
        with pytest.raises(UrlError, match=problem):
            expand_urls(bad)


def test_manifests_list_pipe_commands_only_when_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = tmp_path / "shards.txt"
    text.write_text("s3://b/a.tar\npipe:cat /data/x-{0..1}.tar\n")
    listing = tmp_path / "shards.json"
    listing.write_text(json.dumps([{"url": "pipe:curl -s http://h/a::b", "size": 3}]))
    for manifest in (text, listing):
        with pytest.raises(UrlError, match="Shell command in manifest") as caught:
            read_manifest(manifest)
        assert str(manifest) in str(caught.value) and "SHARDCACHE_MANIFEST_PIPES" in str(
            caught.value
        )
    assert caught.value.command == "pipe:curl -s http://h/a::b"
    with pytest.raises(UrlError, match="Shell command in manifest"):
        expand_urls(["s3://b/c.tar", f"@{text}"])
    assert expand_urls("pipe:cat /data/x.tar") == ["pipe:cat /data/x.tar"]  # your own code
    assert [e.url for e in read_manifest(text, allow_pipes=True)][1:] == [
        "pipe:cat /data/x-0.tar",
        "pipe:cat /data/x-1.tar",
    ]
    monkeypatch.setenv("SHARDCACHE_MANIFEST_PIPES", "allow")
    assert read_manifest(listing)[0].url == "pipe:curl -s http://h/a::b"


def test_warm_refuses_a_manifests_command_without_running_it(
    tmp_path: Path, shard_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``shardcache warm @manifest`` with a command in the manifest: exit status 2, nothing
    run; allowed explicitly, it runs and is cached."""
    marker = tmp_path / "ran"
    manifest = tmp_path / "shards.txt"
    manifest.write_text(f"pipe:touch {marker} && cat {shard_dir / 'train-000000.tar'}\n")
    argv = ["warm", f"@{manifest}", "--cache-dir", str(tmp_path / "c")]
    assert main(argv) == 2
    assert not marker.exists()
    monkeypatch.setenv("SHARDCACHE_MANIFEST_PIPES", "allow")
    assert main(argv) == 0
    assert marker.exists()


# ------------------------------------------------------------------------ fetch / hits


def test_output_is_cached_under_the_command_and_the_command_runs_once(
    tmp_path: Path, shard_dir: Path, counter: Counter
) -> None:
    src = shard_dir / "train-000000.tar"
    url = f"pipe:{counter.shell}; cat {src}"
    cache = _cache(tmp_path)
    path = cache.fetch(url)
    assert path.read_bytes() == src.read_bytes()
    assert cache.fetch(url) == path
    assert _cache(tmp_path).fetch(url) == path  # a later process: a hit too
    assert counter.runs() == 1
    stats = cache.stats()
    assert (stats.misses, stats.hits, stats.bytes_downloaded) == (1, 1, src.stat().st_size)
    # The key is the exact command string, never a file:// path.
    assert cache._identify(url).canonical_url == url and cache._identify(url).namespace == "pipe"
    [entry] = cache.entries()
    assert entry.url == url and entry.size == src.stat().st_size
    assert not [p for p in _data_files(cache) if is_temp_name(p.name)]


def test_drop_in_reads_the_same_samples_as_webdataset_and_runs_each_command_once(
    tmp_path: Path, shard_dir: Path, counter: Counter
) -> None:
    spec = f"pipe:{counter.shell}; cat {shard_dir}/train-{{000000..{SHARDS - 1:06d}}}.tar"
    expected = _samples(spec, wds.tarfile_to_samples())
    assert len(expected) == SHARDS * PER_SHARD and counter.runs() == SHARDS
    cache = _cache(tmp_path)
    for _epoch in range(2):
        assert _samples(spec, shardcache.tarfile_to_samples(cache=cache)) == expected
    assert counter.runs() == 2 * SHARDS  # webdataset's runs, then shardcache's first epoch
    assert cache.stats().misses == SHARDS and cache.stats().hits == SHARDS


def test_command_fetching_from_s3(s3, tmp_path: Path, counter: Counter) -> None:
    data = make_shard(7, PER_SHARD)
    s3.put_objects(BUCKET, {"train-000007.tar": data})
    # The command sees the environment (AWS_ENDPOINT_URL and the keys point at moto).
    script = (
        "import sys, s3fs; "
        f"sys.stdout.buffer.write(s3fs.S3FileSystem().cat('{BUCKET}/train-000007.tar'))"
    )
    url = f"pipe:{counter.shell}; {shlex.quote(sys.executable)} -c {shlex.quote(script)}"
    cache = _cache(tmp_path)
    assert cache.fetch(url).read_bytes() == data
    assert cache.fetch(url).read_bytes() == data
    assert counter.runs() == 1
    assert s3.count("GET", BUCKET, "train-000007.tar") == 1


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on this machine")
def test_curl_command_against_the_s3_endpoint(s3, tmp_path: Path) -> None:
    data = make_shard(8, PER_SHARD)
    s3.put_objects(BUCKET, {"train-000008.tar": data})
    # The shell expands the AWS_* variables the s3 fixture set (curl signs with SigV4).
    curl = (
        "curl -s -S -f --aws-sigv4 aws:amz:$AWS_DEFAULT_REGION:s3 "
        '--user "$AWS_ACCESS_KEY_ID:$AWS_SECRET_ACCESS_KEY" $AWS_ENDPOINT_URL'
    )
    cache = _cache(tmp_path)
    assert cache.fetch(f"pipe:{curl}/{BUCKET}/train-000008.tar").read_bytes() == data
    with pytest.raises(PipeCommandError) as info:
        _cache(tmp_path, retries=0).fetch(f"pipe:{curl}/{BUCKET}/no-such.tar")
    assert info.value.exit_status == 22 and "404" in info.value.stderr  # curl -f on HTTP 404
    assert s3.count("GET", BUCKET, "train-000008.tar") == 1


# ---------------------------------------------------------------------------- failures


def test_failing_command_is_retried_then_named_with_status_and_stderr(
    tmp_path: Path, counter: Counter
) -> None:
    command = f"{counter.shell}; printf partial; echo 'fatal: no credentials' >&2; exit 3"
    cache = _cache(tmp_path, retries=2)
    with pytest.raises(PipeCommandError) as info:
        cache.fetch(f"pipe:{command}")
    error = info.value
    assert isinstance(error, FetchError) and error.retryable
    assert (error.command, error.exit_status, error.attempts) == (command, 3, 3)
    assert error.stderr == "fatal: no credentials\n" and not error.timed_out
    assert "exited with status 3" in str(error) and "fatal: no credentials" in str(error)
    assert "SHARDCACHE_RETRIES=2" in str(error)
    assert counter.runs() == 3  # the first run and two retries
    assert _data_files(cache) == []  # nothing published, no .part left
    assert not cache.contains(f"pipe:{command}")


def test_a_failure_that_clears_is_retried_to_success(tmp_path: Path, counter: Counter) -> None:
    # Fails on its first run only (the counter then holds one line).
    runs = shlex.quote(str(counter.path))
    url = f"pipe:{counter.shell}; [ $(wc -l < {runs}) -ge 2 ] || exit 1; printf payload"
    cache = _cache(tmp_path, retries=1)
    assert cache.fetch(url).read_bytes() == b"payload"
    assert counter.runs() == 2


def test_signals_and_long_stderr_are_reported(tmp_path: Path) -> None:
    cache = _cache(tmp_path, retries=0)
    with pytest.raises(PipeCommandError) as info:
        cache.fetch("pipe:printf abc; kill -TERM $$")
    assert info.value.exit_status == -15 and "killed by signal SIGTERM" in str(info.value)
    noisy = "pipe:head -c 100000 /dev/zero | tr '\\0' x >&2; echo LAST-LINE >&2; exit 1"
    with pytest.raises(PipeCommandError) as info:
        cache.fetch(noisy)
    assert len(info.value.stderr) <= STDERR_TAIL  # bounded, and the end is what is kept
    assert info.value.stderr.endswith("xxLAST-LINE\n")
    assert _data_files(cache) == []


def test_silent_command_is_killed_after_the_io_timeout_with_its_whole_group(
    tmp_path: Path, counter: Counter, pids: PidChannel
) -> None:
    # The shell starts a background child that would outlive a kill of the shell alone.
    url = f"pipe:{counter.shell}; {pids.shell}; printf partial; sleep 300 & wait"
    cache = _cache(tmp_path, io_timeout=0.5, retries=1)
    with pytest.raises(PipeCommandError) as info:
        cache.fetch(url)
    groups = [pids.next_pid(), pids.next_pid()]  # one process group per attempt
    assert info.value.timed_out and info.value.attempts == 2 and counter.runs() == 2
    assert "wrote nothing to its standard output for 0.5s" in str(info.value)
    for pgid in groups:
        assert _members_after_their_exit(pgid) == [], f"process group {pgid} outlived the timeout"
    assert _data_files(cache) == []


def test_closing_a_prefetcher_kills_the_running_command(
    tmp_path: Path, shard_dir: Path, pids: PidChannel
) -> None:
    first = f"pipe:cat {shard_dir}/train-000000.tar"
    hanging = f"pipe:{pids.shell}; printf partial; sleep 300 & wait"
    cache = _cache(tmp_path)  # the default io timeout (60 s) is never reached here
    prefetcher = cache.prefetch([first, hanging], threads=2, depth=2)
    try:
        assert next(prefetcher).url == first  # the second command is running meanwhile
        pgid = pids.next_pid()
        assert _live_members(pgid), "the command should be running"
    finally:
        prefetcher.close()
    assert _members_after_their_exit(pgid) == [], "closing the prefetcher left the command running"
    assert not cache.contains(hanging)
    assert not [p for p in _data_files(cache) if is_temp_name(p.name)]


def test_webdataset_security_setting_refuses_pipe_urls(
    tmp_path: Path, counter: Counter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wds.utils, "enforce_security", True, raising=False)  # webdataset >= 1.0
    with pytest.raises(UrlError, match="WDS_SECURE"):
        _cache(tmp_path).fetch(f"pipe:{counter.shell}; printf x")
    assert counter.runs() == 0


# ------------------------------------------------------------------ size, space, verify


def test_max_bytes_is_kept_once_the_size_is_known(tmp_path: Path) -> None:
    cache = _cache(tmp_path, max_bytes=150_000)
    first = cache.fetch("pipe:head -c 100000 /dev/zero")
    second = cache.fetch("pipe:head -c 100001 /dev/zero")
    assert not first.exists() and second.stat().st_size == 100_001  # the older one evicted
    with pytest.raises(CacheFullError, match="exceeds SHARDCACHE_MAX_BYTES") as info:
        cache.fetch("pipe:head -c 200000 /dev/zero")
    assert info.value.needed == 200_000
    assert _data_files(cache) == [second]  # nothing partial left; the cached shard stays


def test_verify_does_not_rerun_commands_and_checks_the_recorded_size(
    tmp_path: Path, counter: Counter
) -> None:
    url = f"pipe:{counter.shell}; printf 0123456789"
    cache = _cache(tmp_path)
    path = cache.fetch(url)
    report = verify(cache)
    [item] = report.items
    assert item.outcome == "skipped" and "not run again" in item.detail and not report.failed
    path.write_bytes(b"01234")  # damaged in the cache
    report = verify(cache)
    assert report.of("bad")[0].detail == "size 5 bytes, 10 recorded when the command ran"
    assert report.of("bad")[0].removed and not cache.contains(url)
    assert counter.runs() == 1  # verify never ran the command


# ------------------------------------------------------------------ processes and locks


def _fetch_in_process(cache_dir: str, url: str, start, out) -> None:
    cache = ShardCache(cache_dir, retry_backoff=0.01)
    start.wait()
    path = cache.fetch(url)
    out.put((path.read_bytes(), cache.stats().as_dict()))


def test_processes_fetching_one_command_run_it_once(
    tmp_path: Path, shard_dir: Path, counter: Counter
) -> None:
    src = shard_dir / "train-000001.tar"
    # Slow enough that the others are waiting on the lock while it runs.
    url = f"pipe:{counter.shell}; head -c 1000 {src}; sleep 1; tail -c +1001 {src}"
    results = run_together(_fetch_in_process, [(str(tmp_path / "shared"), url)] * 3)
    assert all(data == src.read_bytes() for data, _ in results)
    assert counter.runs() == 1
    assert sum(stats["misses"] for _, stats in results) == 1
    assert sum(s["misses"] + s["shared"] + s["hits"] for _, s in results) == 3
