"""Components of a live cache swapped for symbolic links (what a member of a shared cache, or
anyone who could write below the root, might try).

A swapper process keeps replacing directories below the scope (``data``, ``data/<hh>``,
``.meta/<hh>``, ``.locks/<hh>``, ``.locks``) and published shards by links to an outside
directory that mirrors them with foreign bytes under the same names, then puts them back,
in a tight loop, while reader processes fetch (``open``, eviction on) and a cleaner runs
``clean`` over and over. Nothing outside the root may be written, removed or served: every
read returns the source's bytes or a named ``ShardCacheError`` (a refusal), and the outside
tree is byte-for-byte, inode-for-inode unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import traceback
from pathlib import Path

from torture_scale import scale

from shardcache import ShardCache, ShardCacheError
from shardcache._ops.maintenance import clean
from tools.processes import CTX

SHARDS = 12
FOREIGN = b"FOREIGN BYTES "


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cache(root: str) -> ShardCache:
    return ShardCache(root, scope="node", max_bytes=6 * 20_000, retry_backoff=0.01)


def _reader(root: str, urls: list[str], rounds: int, swapped, target: int, out) -> None:
    """Read every URL ``rounds`` times, and on until the swapper made ``target`` swaps."""
    cache = _cache(root)
    rng = random.Random(os.getpid())
    got: list[tuple[str, str]] = []
    refused: dict[str, int] = {}
    unexpected: list[str] = []
    done = 0
    while done < rounds or swapped.value < target:
        done += 1
        for url in rng.sample(urls, len(urls)):
            try:
                with cache.open(url) as f:
                    got.append((url, _sha(f.read())))
            except ShardCacheError as exc:
                refused[type(exc).__name__] = refused.get(type(exc).__name__, 0) + 1
            except Exception:  # anything else is a finding
                unexpected.append(traceback.format_exc())
    out.put(("reader", got, refused, unexpected))


def _cleaner(root: str, stop, out) -> None:
    cache = _cache(root)
    runs, refused, unexpected = 0, 0, []
    while not stop.is_set():
        try:
            clean(cache)
            runs += 1
        except ShardCacheError:
            refused += 1
        except Exception:
            unexpected.append(traceback.format_exc())
    out.put(("cleaner", runs, refused, unexpected))


def _swap(target: Path, decoy: Path) -> bool:
    """Replace ``target`` by a link to ``decoy`` and put it back; False if it was not there."""
    aside = target.with_name(target.name + ".swapped")
    try:
        os.rename(target, aside)
    except OSError:
        return False
    # Either may fail when the cache made a new one meanwhile: ours then stays aside.
    with contextlib.suppress(OSError):
        os.symlink(decoy, target)
        os.unlink(target)
    with contextlib.suppress(OSError):
        os.rename(aside, target)
    return True


def _swapper(scope: str, outside: str, seed: int, swapped, stop, out) -> None:
    rng = random.Random(seed)
    scope_path, outside_path = Path(scope), Path(outside)
    targets: list[tuple[Path, Path]] = []
    for decoy in outside_path.rglob("*"):
        relative = decoy.relative_to(outside_path)
        targets.append((scope_path / relative, decoy))
    swaps: dict[str, int] = {}
    while not stop.is_set():
        target, decoy = rng.choice(targets)
        if _swap(target, decoy):
            kind = "shard" if decoy.is_file() else str(target.relative_to(scope_path).parts[0])
            swaps[kind] = swaps.get(kind, 0) + 1
            swapped.value += 1
    out.put(("swapper", swaps))


def _snapshot(tree: Path) -> dict[str, tuple[int, int, int, bytes]]:
    """Every entry below ``tree``: (inode, mode, mtime_ns, content for files)."""
    state = {}
    for path in sorted(tree.rglob("*")):
        st = os.lstat(path)
        content = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        state[str(path.relative_to(tree))] = (st.st_ino, st.st_mode, st.st_mtime_ns, content)
    return state


def _prepare(tmp_path: Path) -> tuple[dict[str, str], Path, Path]:
    """Sources (URL -> digest), the cache root (warmed with half the shards) and an outside
    mirror of its scope: the same directories and shard names, foreign bytes."""
    rng = random.Random("swap")
    sources = tmp_path / "src"
    sources.mkdir()
    expected = {}
    for i in range(SHARDS):
        path = sources / f"train-{i:06d}.tar"
        path.write_bytes(rng.randbytes(rng.randrange(8_000, 20_000)))
        expected[str(path)] = _sha(path.read_bytes())
    root = tmp_path / "cache"
    cache = _cache(str(root))
    for url in list(expected)[: SHARDS // 2]:
        cache.fetch(url)
    scope, outside = cache.layout.scope_dir, tmp_path / "outside"
    for path in sorted(scope.rglob("*")):
        if path.is_dir():
            (outside / path.relative_to(scope)).mkdir(parents=True)
    for url in expected:
        mirror = outside / cache.path_for(url).relative_to(scope)
        mirror.parent.mkdir(parents=True, exist_ok=True)
        mirror.write_bytes(FOREIGN + mirror.name.encode())
    return expected, root, outside


def test_symlink_swaps_never_redirect_reads_or_writes(tmp_path: Path, figures) -> None:
    expected, root, outside = _prepare(tmp_path)
    urls, scope = list(expected), root / "node"
    before = _snapshot(outside)

    target = scale(1000, 20000)
    swapped, stop, out = CTX.Value("i", 0), CTX.Event(), CTX.Queue()
    readers = [
        CTX.Process(target=_reader, args=(str(root), urls, 2, swapped, target, out))
        for _ in range(3)
    ]
    others = [
        CTX.Process(target=_cleaner, args=(str(root), stop, out)),
        CTX.Process(target=_swapper, args=(str(scope), str(outside), 3, swapped, stop, out)),
    ]
    for p in [*others, *readers]:
        p.start()
    try:
        results = [out.get(timeout=300) for _ in readers]
        stop.set()
        results += [out.get(timeout=60) for _ in others]
    finally:
        stop.set()
        for p in [*readers, *others]:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in [*readers, *others]] == [0] * 5
    assert _snapshot(outside) == before, "something outside the cache root was changed"
    reads, refused, swaps = _tally(results, expected)
    assert sum(swaps.values()) >= target, swaps
    figures.add(
        "symlink swaps",
        "3 reader processes (open, eviction on) and `clean` in a loop while a process swapped "
        "data, data/<hh>, .meta/<hh>, .locks, .locks/<hh> and published shards for links to "
        "a mirror with foreign bytes",
        sum(swaps.values()),
        f"{reads} reads, all the source's bytes; {sum(refused.values())} refused "
        f"({', '.join(f'{k} x{v}' for k, v in sorted(refused.items())) or 'none'}); "
        "nothing outside the root written, removed or served; swaps: "
        + ", ".join(f"{k} x{v}" for k, v in sorted(swaps.items())),
    )


def _tally(results: list, expected: dict[str, str]) -> tuple[int, dict[str, int], dict]:
    """Check every process's report; (reads, refusals by error type, swaps by kind)."""
    reads, refused, swaps = 0, {}, {}
    for result in results:
        if result[0] == "reader":
            _, got, refusals, unexpected = result
            assert not unexpected, unexpected
            for url, digest in got:
                assert digest == expected[url], f"foreign or wrong bytes served for {url}"
            reads += len(got)
            for name, count in refusals.items():
                refused[name] = refused.get(name, 0) + count
        elif result[0] == "cleaner":
            _, runs, _, unexpected = result
            assert not unexpected, unexpected
            assert runs > 0
        else:
            swaps = result[1]
    assert reads > 0
    return reads, refused, swaps
