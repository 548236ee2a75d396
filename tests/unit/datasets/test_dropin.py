"""``shardcache.tarfile_to_samples`` as a drop-in: webdataset's signature, its URL forms,
and the same samples as webdataset's own ``tarfile_to_samples`` (local files, real processes)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import webdataset as wds
from ports import reserved_port

import shardcache
from shardcache import ConfigError, ShardCache, UrlError
from shardcache._config.settings import PREFETCH_OPTIONS
from shardcache._ops.demo import make_shard
from shardcache._prefetch.prefetcher import Prefetcher

pytestmark = pytest.mark.timeout(120)
PER_SHARD = 5


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    paths = []
    for i in range(3):
        path = tmp_path / "data" / f"shard-{i:03d}.tar"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(make_shard(i, PER_SHARD))
        paths.append(path)
    return paths


def _keys(stage, urls: list[str]) -> list[str]:
    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), stage, wds.to_tuple("__key__"))
    return [key for (key,) in pipeline]


def test_signature_matches_webdatasets_with_cache_options_keyword_only() -> None:
    ours = inspect.signature(shardcache.tarfile_to_samples).parameters
    theirs = inspect.signature(wds.tariterators.tarfile_samples).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == [n for n in theirs if n != "src"]
    for name in positional:
        assert ours[name].default is theirs[name].default
    keyword_only = {n for n, p in ours.items() if p.kind is p.KEYWORD_ONLY}
    assert keyword_only == {"cache", "threads", "depth", "stall_timeout"}
    samples = inspect.signature(shardcache.tarfile_samples).parameters
    assert list(samples)[: len(theirs)] == list(theirs)


def test_every_prefetch_entry_point_names_the_options_as_the_settings_do() -> None:
    """The stage, its drop-ins, ``ShardCache.prefetch`` and ``Prefetcher`` all take the
    prefetch options by the names config.PREFETCH_OPTIONS maps to settings."""
    for call in (
        shardcache.stage,
        shardcache.tarfile_to_samples,
        shardcache.tarfile_samples,
        ShardCache.prefetch,
        Prefetcher,
    ):
        names = set(inspect.signature(call).parameters)
        assert PREFETCH_OPTIONS.keys() <= names, call
        assert not names & {"prefetch_depth", "thread"}, call


def test_handler_first_as_in_webdataset(tmp_path: Path, shards: list[Path]) -> None:
    """``tarfile_to_samples(wds.warn_and_continue)`` takes the handler, as webdataset does."""
    shards[1].write_bytes(b"not a tar file" * 64)
    stage = shardcache.tarfile_to_samples(wds.warn_and_continue, cache=ShardCache(tmp_path / "c"))
    with pytest.warns(UserWarning):
        keys = _keys(stage, [str(p) for p in shards])
    reference = wds.tarfile_to_samples(wds.warn_and_continue)
    with pytest.warns(UserWarning):
        assert keys == _keys(reference, [str(p) for p in shards])
    assert len(keys) == 2 * PER_SHARD


def test_select_and_rename_files_positionally(tmp_path: Path, shards: list[Path]) -> None:
    def select(name: str) -> bool:  # webdataset 1.0.2 renames first, older ones select first
        return name.endswith((".cls", ".label"))

    def rename(name: str) -> str:
        return name.replace(".cls", ".label")

    urls = [str(p) for p in shards]
    ours = shardcache.tarfile_to_samples(
        wds.reraise_exception, select, rename, cache=ShardCache(tmp_path / "c")
    )
    theirs = wds.tarfile_to_samples(wds.reraise_exception, select, rename)
    got = list(wds.DataPipeline(wds.SimpleShardList(urls), ours))
    want = list(wds.DataPipeline(wds.SimpleShardList(urls), theirs))
    # Ours also names the cached copy each sample came from (__local_path__, by design).
    assert [sorted(set(s) - {"__local_path__"}) for s in got] == [sorted(s) for s in want]
    assert len(got) == len(shards) * PER_SHARD  # every sample, with its class only
    assert all(set(s) >= {"label"} and not {"cls", "npy"} & set(s) for s in got)
    assert [s["label"] for s in got] == [s["label"] for s in want]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (shardcache.tarfile_to_samples, "the cache is a keyword argument"),
        (shardcache.stage, "the cache is a keyword argument"),
        (lambda c: shardcache.tarfile_to_samples("warn"), "handler must be a callable"),
        (lambda c: shardcache.tarfile_to_samples(select_files="*.jpg"), "select_files must be"),
        (lambda c: shardcache.tarfile_to_samples(rename_files=3), "rename_files must be"),
        (lambda c: shardcache.tarfile_to_samples(cache="/tmp/x"), "cache must be a"),
        (
            lambda c: shardcache.tarfile_to_samples(wds.reraise_exception, None, None, c),
            "positional",
        ),
    ],
)
def test_wrong_types_fail_at_construction(tmp_path: Path, call, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        call(ShardCache(tmp_path))


@pytest.mark.parametrize(
    "options", [{"threads": 0}, {"threads": "2"}, {"depth": 1.5}, {"stall_timeout": -1}]
)
def test_bad_prefetch_values_fail_at_construction(options: dict) -> None:
    with pytest.raises(ConfigError, match=next(iter(options))):
        shardcache.tarfile_to_samples(**options)


def test_bare_url_strings_are_accepted_and_other_items_refused(
    tmp_path: Path, shards: list[Path]
) -> None:
    """webdataset's StreamingOpen takes URL strings as well as dicts; so does the stage."""
    stage = shardcache.stage(cache=ShardCache(tmp_path / "c"))
    items = [str(shards[0]), {"url": str(shards[1]), "extra": 1}]
    assert [(s["url"], s.get("extra")) for s in stage(items)] == [
        (str(shards[0]), None),
        (str(shards[1]), 1),
    ]
    for bad in ({"path": "a.tar"}, 3):
        with pytest.raises(TypeError, match="SimpleShardList"):
            list(stage(iter([bad])))


def test_local_path_forms_give_webdatasets_samples(
    tmp_path: Path, shards: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative paths, absolute paths and file:// URLs: one cache entry per file."""
    monkeypatch.chdir(tmp_path)
    cache = ShardCache(tmp_path / "cache")
    absolute = [str(p) for p in shards]
    want = _keys(wds.tarfile_to_samples(), absolute)
    relative = [str(p.relative_to(tmp_path)) for p in shards]
    forms = [
        absolute,
        relative,
        [p.as_uri() for p in shards],  # file:///abs
        [f"file:{p}" for p in shards],  # RFC 8089's short form, which gopen reads
        [f"file://localhost{p}" for p in shards],
    ]
    for urls in forms[1:]:
        assert _keys(wds.tarfile_to_samples(), urls) == want  # webdataset reads them all
    for urls in forms:
        assert _keys(shardcache.tarfile_to_samples(cache=cache), urls) == want
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (len(shards), (len(forms) - 1) * len(shards))


def test_file_urls_are_percent_decoded_as_webdataset_does(tmp_path: Path) -> None:
    path = tmp_path / "with space" / "shard 0.tar"
    path.parent.mkdir()
    path.write_bytes(make_shard(0, PER_SHARD))
    url = path.as_uri()
    assert "%20" in url
    cache = ShardCache(tmp_path / "cache")
    want = _keys(wds.tarfile_to_samples(), [str(path)])  # webdataset < 1.0 does not decode
    assert _keys(shardcache.tarfile_to_samples(cache=cache), [url]) == want
    assert cache.path_for(url) == cache.path_for(str(path))  # one entry for both spellings


def test_stdin_is_read_once_in_order_and_uncached(tmp_path: Path, shards: list[Path]) -> None:
    """``-`` reads standard input in its place in the shard list, as webdataset's gopen does."""
    script = textwrap.dedent(
        """
        import sys
        import webdataset as wds
        import shardcache

        cache = shardcache.ShardCache(sys.argv[1])
        urls = [sys.argv[2], "-", sys.argv[3]]
        pipeline = wds.DataPipeline(
            wds.SimpleShardList(urls),
            shardcache.tarfile_to_samples(cache=cache, threads=2),
            wds.to_tuple("__key__"),
        )
        for (key,) in pipeline:
            print(key)
        print("entries", len(cache.entries()))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cache"), str(shards[0]), str(shards[2])],
        input=shards[1].read_bytes(),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stdout.decode().split()
    want = _keys(wds.tarfile_to_samples(), [str(p) for p in shards])
    assert lines[:-2] == want
    assert lines[-2:] == ["entries", "2"]  # standard input is not cached


def test_schemes_fsspec_does_not_know_say_to_use_pipe(tmp_path: Path, shards: list[Path]) -> None:
    """webdataset hands ais:// or scp:// to command-line tools; here they are a clear UrlError
    (through the handler like any failed shard) that points at pipe: commands."""
    stage = shardcache.tarfile_to_samples(cache=ShardCache(tmp_path / "c"))
    with pytest.raises(UrlError, match="pipe:") as caught:
        _keys(stage, ["ais://bucket/x.tar"])
    assert caught.value.protocol == "ais"
    skipping = shardcache.tarfile_to_samples(lambda exn: True, cache=ShardCache(tmp_path / "c"))
    assert len(_keys(skipping, ["scp://host/x.tar", str(shards[0])])) == PER_SHARD


def test_unreachable_host_is_an_ioerror_as_in_webdataset(tmp_path: Path) -> None:
    """webdataset raises IOError when a shard cannot be opened (its own suite checks this for
    an unreachable host); the drop-in's FetchError for a refused connection is one too,
    and so are a missing file and a failed pipe: command."""
    cache = ShardCache(tmp_path / "c", retries=1, retry_backoff=0.01)
    stage = shardcache.tarfile_to_samples(cache=cache)
    with reserved_port() as port, pytest.raises(IOError) as caught:  # nothing listens there
        _keys(stage, [f"http://127.0.0.1:{port}/missing.tar"])
    assert isinstance(caught.value, shardcache.PermanentFetchError)  # refused on loopback
    with pytest.raises(IOError):
        _keys(stage, [str(tmp_path / "no-such-shard.tar")])
    with pytest.raises(IOError) as failed:
        _keys(stage, ["pipe:exit 3"])
    assert isinstance(failed.value, shardcache.PipeCommandError)
