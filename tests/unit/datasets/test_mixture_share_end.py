"""A mixture's share end lets each source finish the shard it read last, as a lone dataset
does: the download of a shard whose samples were all read as its bytes landed is published,
not cancelled (the next epoch reads it from the cache), and its verdict is awaited, so a
shard whose bytes fail their check after they were read is an error, not a quiet end."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from mixture_files import MixtureFiles

from shardcache import IntegrityError, MixtureDataset, ShardCache, Source
from shardcache._cache.shard_cache import Wiring
from shardcache._config.settings import Settings
from shardcache._prefetch.prefetcher import Prefetcher
from shardcache._store.growing import GrowingFile
from shardcache._transfer.remote import Remote

pytestmark = pytest.mark.timeout(60)
SAMPLES = 4


def _mixture(
    tmp_path: Path, at_the_end: Callable[[], None]
) -> tuple[MixtureDataset, ShardCache, MixtureFiles]:
    """Two one-shard sources, read while they download through a cache whose downloads
    write every byte, then call ``at_the_end`` before reporting the last ones."""
    files = MixtureFiles(tmp_path, [[SAMPLES], [SAMPLES]])  # indexed: reads stop at a piece's end

    class HeldAtTheEnd(Remote):
        def download(self, info, out, progress=None, opened=None):
            def held(*, phase: str, bytes_done: int, bytes_total: int | None) -> None:
                if bytes_done == info.size and phase != "publishing":
                    at_the_end()
                if progress is not None:
                    progress(phase=phase, bytes_done=bytes_done, bytes_total=bytes_total)

            return super().download(info, out, held, opened)

    settings = Settings.resolve(cache_dir=tmp_path / "reading", max_bytes=1 << 30)
    cache = ShardCache._wired(settings, Wiring(remote=HeldAtTheEnd))
    mixture = MixtureDataset(
        [
            Source(urls, samples=SAMPLES, name=name, index=index)
            for name, urls, index in files.parts
        ],
        cache=cache,
        threads=1,
        rank=0,
        world_size=1,
    )
    return mixture, cache, files


def test_a_source_s_last_shard_read_while_downloading_is_published_at_its_share_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each source is one shard, read while it downloads: every byte has landed (the
    reader has every sample) but the download has not reported its last bytes yet. It goes
    on only once its consumer is done with the shard: the stage waits for the shard's
    verdict, or the prefetcher was closed (cancelled). The share's end must wait."""
    done_with_shard = threading.Event()
    closed = Prefetcher.close

    def close(self: Prefetcher, *args: object, **kwargs: object) -> None:
        shared = self._shared
        if shared is not None:  # once cancelled, the held downloads go on (and stop)
            threading.Thread(
                target=lambda: shared.cancelled.wait(30) and done_with_shard.set(), daemon=True
            ).start()
        closed(self, *args, **kwargs)

    verdict = GrowingFile.verdict

    def waited_for(self: GrowingFile, until_stall):
        done_with_shard.set()  # the stage waits for the download's outcome
        return verdict(self, until_stall)

    monkeypatch.setattr(Prefetcher, "close", close)
    monkeypatch.setattr(GrowingFile, "verdict", waited_for)

    mixture, cache, files = _mixture(tmp_path, lambda: done_with_shard.wait(30) or _fail())
    shards = [url for _, urls, _ in files.parts for url in urls]
    samples = iter(mixture)
    keys = {next(samples)["__key__"] for _ in range(2 * SAMPLES)}
    assert keys == files.keys["m0"] | files.keys["m1"]  # every sample read, ...
    assert [cache.contains(url) for url in shards] == [False, False]  # ... none published yet
    assert next(samples, None) is None  # the epoch's end
    assert [cache.contains(url) for url in shards] == [True, True]  # published, not cancelled
    assert cache.stats().misses == 2


def test_a_source_s_last_shard_failing_its_check_after_it_was_read_is_an_error(
    tmp_path: Path,
) -> None:
    """Every sample of both sources read while their bytes landed; then each download finds
    its bytes damaged and starts again. The share's end raises the stage's error, that the
    samples read came from bytes that were not verified (the mixture's handler, reraise by
    default, sees it), instead of ending the epoch as if the samples were sound."""
    all_read = threading.Event()

    def damaged() -> None:
        assert all_read.wait(30)
        raise IntegrityError("the bytes do not match the object's checksum (test)")

    mixture, _, files = _mixture(tmp_path, damaged)
    samples = iter(mixture)
    keys = {next(samples)["__key__"] for _ in range(2 * SAMPLES)}
    assert keys == files.keys["m0"] | files.keys["m1"]
    all_read.set()
    with pytest.raises(
        IntegrityError, match="samples already read came from bytes that were not verified"
    ):
        next(samples, None)


def _fail() -> None:
    pytest.fail("the download's consumer neither waited for it nor cancelled it in 30 s")
