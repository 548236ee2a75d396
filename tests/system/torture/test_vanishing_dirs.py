"""Directories deleted under a live cache (tmp cleaners, a user's ``rm -rf``).

Real processes read shards from the S3 server through every public way in (``open``, the
prefetcher, the WebDataset stage, ``warm``), with eviction on, while another process keeps
removing random cache directories: the root, the scope, ``data``, ``data/<hh>``,
``.meta/<hh>``, ``.locks/<hh>``, ``.locks``. Every read must return the source's bytes, no
process may fail, and no file at a final name may ever be partial.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tars import tar_bytes
from torture_scale import scale

from shardcache import ShardCache
from shardcache.testing import S3Server
from tools.processes import CTX

BUCKET = "vanish"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reader(kind: str, cache_dir: str, urls: list[str], rounds: int, seed: int, done, out):
    """Read every URL ``rounds`` times (shuffled) in one way; report digests and errors."""
    cache = ShardCache(cache_dir, scope="node", max_bytes=len(urls) * 30_000, retry_backoff=0.01)
    rng = random.Random(seed)
    got: list[tuple[str, str]] = []
    errors: list[str] = []
    try:
        for _ in range(rounds):
            order = rng.sample(urls, len(urls))
            if kind == "open":
                for url in order:
                    with cache.open(url) as f:
                        got.append((url, _sha(f.read())))
                    done.value += 1
            elif kind == "prefetch":
                with cache.prefetch(order, threads=2, depth=3) as shards:
                    for url, path in shards:
                        with cache.open_prefetched(path) as f:
                            got.append((url, _sha(f.read())))
                        done.value += 1
            else:  # the WebDataset stage
                from shardcache import stage

                for sample in stage(cache=cache, threads=2, depth=3)({"url": u} for u in order):
                    got.append((sample["url"], _sha(sample["stream"].read())))
                    done.value += 1
    except Exception as exc:  # reported, the parent fails the test with it
        errors.append(f"{type(exc).__name__}: {exc}")
    out.put((kind, got, errors, cache.stats().as_dict()))


def _remover(root: str, seed: int, stop, out) -> None:
    """Remove a random cache directory every few milliseconds until stopped."""
    rng = random.Random(seed)
    root_path = Path(root)
    scope = root_path / "node"
    removed: dict[str, int] = {}
    while not stop.wait(rng.uniform(0.002, 0.02)):  # pacing, not synchronisation
        choices = {
            "root": [root_path],
            "scope": [scope],
            "data": [scope / "data"],
            ".locks": [scope / ".locks"],
        }
        for name, parent in (
            ("data/<hh>", "data"),
            (".meta/<hh>", ".meta"),
            (".locks/<hh>", ".locks"),
        ):
            with_dirs = [p for p in (scope / parent).glob("*") if p.is_dir()]
            if with_dirs:
                choices[name] = with_dirs
        weights = {"root": 1, "scope": 1, "data": 1, ".locks": 1}
        name = rng.choices(list(choices), [weights.get(n, 4) for n in choices])[0]
        shutil.rmtree(rng.choice(choices[name]), ignore_errors=True)
        removed[name] = removed.get(name, 0) + 1
    out.put(("remover", removed))


@pytest.mark.parametrize("read_while_downloading", ["on", "off"])
def test_directories_removed_under_live_readers(
    tmp_path: Path, s3: S3Server, figures, monkeypatch: pytest.MonkeyPatch, read_while_downloading
) -> None:
    # Every process started below inherits it: readers following in-flight files whose
    # directories vanish (on), and readers of published files only (off).
    monkeypatch.setenv("SHARDCACHE_READ_WHILE_DOWNLOADING", read_while_downloading)
    rng = random.Random("vanish")
    objects = {  # tars (the stage checks its streams are), of random sizes and bytes
        f"train-{i:06d}.tar": tar_bytes(
            [(f"s{i}", {"bin": rng.randbytes(rng.randrange(8_000, 38_000))})]
        )
        for i in range(24)
    }
    s3.put_objects(BUCKET, objects)
    urls = [f"s3://{BUCKET}/{key}" for key in objects]
    expected = {f"s3://{BUCKET}/{k}": _sha(v) for k, v in objects.items()}
    cache_dir = tmp_path / "cache"
    rounds = scale(3, 12)
    kinds = ["open", "open", "prefetch", "stage"]

    done, stop, out = CTX.Value("i", 0), CTX.Event(), CTX.Queue()
    readers = [
        CTX.Process(target=_reader, args=(k, str(cache_dir), urls, rounds, n, done, out))
        for n, k in enumerate(kinds)
    ]
    remover = CTX.Process(target=_remover, args=(str(cache_dir), 7, stop, out))
    for p in [*readers, remover]:
        p.start()
    # ``warm`` (the CLI, a process of its own) runs beside the readers.
    warm = subprocess.Popen(
        [
            *(sys.executable, "-m", "shardcache", "warm", "--cache-dir", str(cache_dir)),
            *("--scope", "node", "--threads", "4", *urls),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "SHARDCACHE_MAX_BYTES": str(len(urls) * 30_000)},
    )
    try:
        results = [out.get(timeout=300) for _ in readers]
        warm_output, _ = warm.communicate(timeout=300)
        stop.set()
        removed = out.get(timeout=60)[1]
    finally:
        stop.set()
        if warm.poll() is None:
            warm.kill()
        for p in [*readers, remover]:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in [*readers, remover]] == [0] * (len(readers) + 1)

    reads = 0
    for kind, got, errors, _stats in results:
        assert not errors, f"{kind}: " + "\n".join(errors)
        assert len(got) == rounds * len(urls), kind
        for url, digest in got:
            assert digest == expected[url], f"{kind}: wrong bytes for {url}"
        reads += len(got)
    assert warm.returncode == 0, warm_output

    # Whatever is left at a final name is a complete, correct shard.
    cache = ShardCache(cache_dir, scope="node")
    for url in urls:
        path = cache.path_for(url)
        if path.exists():
            assert _sha(path.read_bytes()) == expected[url]
    assert sum(removed.values()) >= scale(10, 50), removed
    figures.add(
        f"vanishing directories (read while downloading {read_while_downloading})",
        f"{len(kinds)} reader processes (open x2, prefetch, WebDataset stage) and `warm`, "
        f"eviction on, while a process ran `rm -rf` on random cache directories",
        sum(removed.values()),
        f"{reads} reads, all byte-identical; 0 process failures; warm exit 0; removed: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(removed.items())),
    )
