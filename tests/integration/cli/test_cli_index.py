"""``shardcache index`` (the sample index of a shard list) and ``shardcache warm --split
dataset`` (warming what ResumableDataset reads through each task's cache), on local tars
and on moto."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from tars import shard_samples, tar_bytes

from shardcache import ResumableDataset, ShardCache
from shardcache._cli.main import main
from shardcache._datasets.sample_index import load_index

BUCKET = "indexed"
COUNTS = [3, 7, 1, 12, 5, 9, 2, 8]  # samples per shard: uneven, so the split cuts shards
WARM_COUNTS = [*COUNTS, 0, 4, 6, 11]  # the warm tests' shards: shard 8 holds no sample
EMPTY = len(COUNTS)


def _write_shards(root: Path, counts: list[int] = COUNTS) -> tuple[str, list[str]]:
    """Local shards of ``counts`` samples (in several tar formats, with a directory and a
    ``__meta__`` member in some); returns the brace spec and the URLs."""
    root.mkdir(parents=True, exist_ok=True)
    formats = [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT]
    urls = []
    for shard, count in enumerate(counts):
        samples = shard_samples(shard, count, size=100 + 37 * shard)
        extras = [(1, "dir/"), (2, "__meta__")] if count > 2 and shard % 2 else []
        path = root / f"train-{shard:02d}.tar"
        path.write_bytes(tar_bytes(samples, tar_format=formats[shard % 3], extras=extras))
        urls.append(str(path))
    return f"{root}/train-{{00..{len(counts) - 1:02d}}}.tar", urls


def _tarfile_starts(path: str) -> list[int]:
    """Where each sample starts, by Python's tarfile: the header offset of the first member
    of each run of members sharing a key (name up to the first dot)."""
    starts, previous = [], None
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            if not member.isfile() or "." not in member.name:
                continue
            key = member.name.split(".", 1)[0]
            if key != previous:
                starts.append(member.offset)
            previous = key
    return starts


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SHARDCACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _launch(monkeypatch: pytest.MonkeyPatch, rank: int, world: int, **more: str) -> None:
    """torchrun's variables for ``rank`` of ``world`` (``more``: LOCAL_RANK etc.)."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", more.pop("LOCAL_RANK", str(rank)))
    for name, value in more.items():
        monkeypatch.setenv(name, value)


# ------------------------------------------------------------------------------ index


def test_index_records_every_samples_offset_as_tarfile_sees_it(tmp_path, cache_dir, capsys) -> None:
    spec, urls = _write_shards(tmp_path / "data")
    out = tmp_path / "train.index.json"
    code, stdout, stderr = _cli(capsys, "index", spec, "-o", str(out), "--threads", "3")
    assert code == 0, stderr
    assert stdout.splitlines()[0].startswith(f"index: {len(urls)} shards, {sum(COUNTS)} samples, ")
    assert f"(cached 0, misses {len(urls)}, shared 0; " in stdout
    assert stdout.rstrip().endswith(f"written to {out}")
    assert "warning" not in stdout
    assert f"index: {len(urls)}/{len(urls)} shards, " in stderr  # the progress line
    index = load_index(str(out), urls)
    for url, count in zip(urls, COUNTS, strict=True):
        assert index[url].count == count
        assert list(index[url].starts) == _tarfile_starts(url)
        assert index[url].size == os.path.getsize(url)
    # Fetched through the cache: a later warm or training finds them there.
    cache = ShardCache(cache_dir)
    assert all(cache.contains(url) for url in urls)
    # Again: all hits, the same document.
    first = out.read_text()
    code, stdout, _ = _cli(capsys, "index", spec, "-o", str(out), "--json")
    assert code == 0
    summary = json.loads(stdout)
    assert summary == {
        **summary,
        "index": str(out),
        "shards": len(urls),
        "samples": sum(COUNTS),
        "bytes_indexed": sum(os.path.getsize(u) for u in urls),
        "cached": len(urls),
        "misses": 0,
        "bytes_downloaded": 0,
        "empty_shards": [],
        "warnings": [],
    }
    assert out.read_text() == first


def test_index_to_s3_is_what_the_dataset_reads(s3, tmp_path, monkeypatch, capsys) -> None:

    objects = {f"train-{i:02d}.tar": tar_bytes(shard_samples(i, n)) for i, n in enumerate(COUNTS)}
    etags = s3.put_objects(BUCKET, objects)
    spec = f"s3://{BUCKET}/train-{{00..{len(COUNTS) - 1:02d}}}.tar"
    target = f"s3://{BUCKET}/meta/train.index.json"
    monkeypatch.setenv("SHARDCACHE_DIR", str(tmp_path / "indexer"))
    code, stdout, stderr = _cli(capsys, "index", spec, "-o", target)
    assert code == 0, stderr
    assert stdout.rstrip().endswith(f"written to {target}")
    index = load_index(target, [f"s3://{BUCKET}/{key}" for key in objects])
    assert [index[f"s3://{BUCKET}/{k}"].etag for k in objects] == [etags[k] for k in objects]

    # A training job with a fresh cache: splitting the epoch reads the index, no shard.
    s3.clear_requests()
    cache = ShardCache(tmp_path / "trainer")
    dataset = ResumableDataset(
        spec, index=target, cache=cache, rank=0, world_size=1, shuffle_shards=False
    ).prepare()
    assert s3.count("GET", BUCKET, "meta/train.index.json") >= 1
    assert sum(s3.count("GET", BUCKET, key) for key in objects) == 0
    keys = [sample["__key__"] for sample in dataset]
    assert keys == [key for i, n in enumerate(COUNTS) for key, _ in shard_samples(i, n)]


def test_an_unwritable_index_url_fails_with_exit_1(
    s3, fault_proxy, tmp_path, monkeypatch, capsys
) -> None:
    spec, _urls = _write_shards(tmp_path / "data", [2, 3])
    monkeypatch.setenv("SHARDCACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint_url)
    fault_proxy.add_fault("status:403", times=None, method="PUT", error_code="AccessDenied")
    target = f"s3://{BUCKET}/train.index.json"
    code, stdout, stderr = _cli(capsys, "index", spec, "-o", target)
    assert code == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"shardcache: SampleIndexError: cannot write the sample index {target}: "
    )
    assert "PermissionError" in last and "Traceback" not in stderr
    assert stdout == ""


def test_a_missing_shard_fails_the_run_and_writes_nothing(s3, tmp_path) -> None:
    s3.put_objects(BUCKET, {"train-0.tar": tar_bytes(shard_samples(0, 3))})
    out = tmp_path / "train.index.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardcache",
            "index",
            f"s3://{BUCKET}/train-{{0..1}}.tar",
            "-o",
            str(out),
        ],
        env={**os.environ, "SHARDCACHE_DIR": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("shardcache: RemoteNotFoundError: "), result.stderr
    assert f"s3://{BUCKET}/train-1.tar" in last
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not out.exists()


def test_a_missing_local_shard_fails_with_exit_1(tmp_path, cache_dir, capsys) -> None:
    spec, _urls = _write_shards(tmp_path / "data", [2, 2])
    out = tmp_path / "train.index.json"
    code, stdout, stderr = _cli(capsys, "index", spec, str(tmp_path / "nope.tar"), "-o", str(out))
    assert code == 1
    assert stderr.strip().splitlines()[-1].startswith("shardcache: RemoteNotFoundError: ")
    assert "nope.tar" in stderr
    assert stdout == "" and not out.exists()


@pytest.mark.parametrize(
    ("junk", "seen"),
    [
        (b"not a tar" * 1000, "the shard starts b'not a tarnot a t', not a tar header"),
        (b"hello", "the shard is 5 bytes long, starting b'hello'"),
        (b"", "the shard is empty (0 bytes)"),
    ],
    ids=["not-a-tar", "five-bytes", "empty"],
)
def test_a_shard_that_is_not_a_tar_fails_with_exit_1(
    tmp_path, cache_dir, capsys, junk: bytes, seen: str
) -> None:
    spec, _urls = _write_shards(tmp_path / "data", [2, 2])
    bad = tmp_path / "junk.tar"
    bad.write_bytes(junk)
    out = tmp_path / "train.index.json"
    code, stdout, stderr = _cli(capsys, "index", spec, str(bad), "-o", str(out))
    assert code == 1
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"shardcache: ShardFormatError: {bad}: {seen}; expected a tar file")
    assert stdout == "" and not out.exists()


def test_a_shard_without_samples_is_a_warning(tmp_path, cache_dir, capsys) -> None:
    spec, urls = _write_shards(tmp_path / "data", [4, 0, 3])
    out = tmp_path / "train.index.json"
    code, stdout, stderr = _cli(capsys, "index", spec, "-o", str(out))
    assert code == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].startswith("index: 3 shards, 7 samples, ")
    assert lines[1].startswith("warning: 1 of 3 shards hold no sample")
    assert lines[2] == f"  {urls[1]}"
    assert load_index(str(out), urls)[urls[1]].count == 0
    code, stdout, _ = _cli(capsys, "index", spec, "-o", str(out), "--json")
    assert code == 0
    summary = json.loads(stdout)
    assert summary["empty_shards"] == [urls[1]]
    assert summary["warnings"] == ["1 of 3 shards hold no sample"]


@pytest.mark.parametrize(
    "argv",
    [
        ["index", "/data/x.tar"],  # no -o
        ["index", "-o", "out.json"],  # no SPEC
        ["index", "/data/x.tar", "-o", "/nonexistent/dir/out.json"],
        ["index", "/data/x.tar", "-o", "/tmp"],
        ["index", "/data/x-{1..", "-o", "out.json"],
        ["index", "/data/x.tar", "-o", "out.json", "--threads", "0"],
        ["index", "/data/x.tar", "-o", "nosuchprotocol://b/out.json"],
    ],
    ids=["no-output", "no-spec", "missing-dir", "a-directory", "bad-spec", "threads-0", "protocol"],
)
def test_index_usage_errors_are_one_line_and_exit_2(argv, cache_dir, capsys) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith("shardcache")
    assert captured.out == ""
    assert not cache_dir.exists()  # refused before anything was fetched


def test_index_has_help_with_examples(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["index", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "  shardcache index " in out and "-o FILE" in out


# ---------------------------------------------------------------- warm --split dataset


@pytest.fixture
def indexed(tmp_path, cache_dir, capsys) -> tuple[str, list[str], str]:
    """Local shards (one empty), their index file; the indexing's own cache removed."""
    spec, urls = _write_shards(tmp_path / "data", WARM_COUNTS)
    index = str(tmp_path / "train.index.json")
    assert _cli(capsys, "index", spec, "-o", index)[0] == 0
    ShardCache(cache_dir).evict(0)
    return spec, urls, index


def _expected(spec: str, index: str, rank: int, world: int, **options: object) -> list[str]:

    dataset = ResumableDataset(spec, index=index, rank=rank, world_size=world, **options)
    return dataset.cache_urls()


def _cached(cache: ShardCache, urls: list[str]) -> list[str]:
    return [url for url in urls if cache.contains(url)]


def test_warm_split_dataset_warms_each_ranks_cache_urls(
    indexed, cache_dir, monkeypatch, capsys
) -> None:
    spec, urls, index = indexed
    world, union = 3, set()
    for rank in range(world):
        with monkeypatch.context() as env:
            _launch(env, rank, world, LOCAL_WORLD_SIZE=str(world))
            argv = ["warm", spec, "--split", "dataset", "--index", index, "--seed", "5"]
            code, stdout, stderr = _cli(capsys, *argv)
        assert code == 0, stderr
        expected = _expected(spec, index, rank, world, seed=5)
        assert 0 < len(expected) < len(urls)
        assert f"{len(expected)} of {len(expected)} shards ok, 0 failed" in stdout
        assert f"what rank {rank} of {world} reads in every epoch" in stderr
        assert _cached(ShardCache(cache_dir, rank=rank), urls) == expected
        union.update(expected)
    # Every shard with samples is some rank's; the empty one (8) is nobody's.
    assert union == {url for i, url in enumerate(urls) if i != EMPTY}
    # Not split_by_node's rule: the sample split decides (here on shard 1, at least).
    assert any(_expected(spec, index, r, world, seed=5) != urls[r::world] for r in range(world))


def test_warm_split_dataset_follows_seed_shuffle_and_remainder(
    indexed, cache_dir, monkeypatch, capsys
) -> None:
    spec, urls, index = indexed
    options = ["--seed", "11", "--no-shuffle-shards", "--remainder", "drop"]
    with monkeypatch.context() as env:
        _launch(env, 1, 4, LOCAL_WORLD_SIZE="4")
        code, _, stderr = _cli(
            capsys, "warm", spec, "--split", "dataset", "--index", index, *options
        )
    assert code == 0, stderr
    expected = _expected(spec, index, 1, 4, seed=11, shuffle_shards=False, remainder="drop")
    assert _cached(ShardCache(cache_dir, rank=1), urls) == expected
    # The options reached the plan: the default seed and shuffle give rank 1 other shards.
    assert expected != _expected(spec, index, 1, 4)


def test_warm_split_dataset_node_scope_local_rank_0_warms_the_nodes(
    indexed, cache_dir, monkeypatch, capsys
) -> None:
    spec, urls, index = indexed
    node = {"SHARDCACHE_SCOPE": "node", "LOCAL_WORLD_SIZE": "2"}
    argv = ["warm", spec, "--split", "dataset", "--index", index]
    with monkeypatch.context() as env:
        _launch(env, 3, 4, LOCAL_RANK="1", GROUP_RANK="1", **node)
        code, stdout, _ = _cli(capsys, *argv)
    assert code == 0
    assert stdout.startswith("warm: nothing to do (local rank 1;")
    assert not (cache_dir / "node").exists()

    warmed = []
    for rank in (0, 2):  # local rank 0 of node 0, then of node 1 (each its own disk)
        cache_root = cache_dir.parent / f"node-{rank // 2}-disk"
        with monkeypatch.context() as env:
            _launch(env, rank, 4, LOCAL_RANK="0", GROUP_RANK=str(rank // 2), **node)
            env.setenv("SHARDCACHE_DIR", str(cache_root))
            code, stdout, stderr = _cli(capsys, *argv)
            # What the dataset itself, launched the same way, reads through the node's cache.
            expected = ResumableDataset(spec, index=index).cache_urls()
        assert code == 0, stderr
        assert f"what ranks {rank}..{rank + 1} of 4 on this node read" in stderr
        assert _cached(ShardCache(cache_root, scope="node"), urls) == expected
        warmed += expected
    assert set(warmed) == {url for i, url in enumerate(urls) if i != EMPTY}


def test_warm_split_dataset_node_scope_with_nodes_of_unequal_or_unknown_size(
    indexed, cache_dir, monkeypatch, capsys
) -> None:
    spec, urls, index = indexed
    argv = ["warm", spec, "--split", "dataset", "--index", index]
    # 3 ranks on nodes of 2 and 1: the dataset gives each rank its own part; node 0 reads
    # the parts of ranks 0 and 1.
    with monkeypatch.context() as env:
        _launch(env, 0, 3, LOCAL_WORLD_SIZE="2", SHARDCACHE_SCOPE="node")
        code, _, stderr = _cli(capsys, *argv)
    assert code == 0, stderr
    parts = {*_expected(spec, index, 0, 3), *_expected(spec, index, 1, 3)}
    node_cache = ShardCache(cache_dir, scope="node")
    assert _cached(node_cache, urls) == [url for url in urls if url in parts]
    node_cache.evict(0)
    # Ranks per node unknown: local rank 0 warms every shard the dataset reads.
    with monkeypatch.context() as env:
        _launch(env, 2, 4, LOCAL_RANK="0", SHARDCACHE_SCOPE="node")
        code, _, stderr = _cli(capsys, *argv)
    assert code == 0, stderr
    assert "local rank 0 of a node of unknown size" in stderr
    assert _cached(node_cache, urls) == [u for i, u in enumerate(urls) if i != EMPTY]


def test_warm_split_dataset_without_index_is_a_usage_error(tmp_path, cache_dir, capsys) -> None:
    spec, _urls = _write_shards(tmp_path / "data", [2, 2])
    code, stdout, stderr = _cli(capsys, "warm", spec, "--split", "dataset")
    assert code == 2
    assert stderr.strip().splitlines() == [
        "shardcache warm: error: --split dataset needs --index FILE: make the shard list's "
        "sample index first with 'shardcache index SPEC -o FILE' (without it every shard "
        "would be downloaded to split the epoch by samples) (see shardcache warm --help)"
    ]
    assert stdout == ""
    assert not cache_dir.exists()  # nothing downloaded


@pytest.mark.parametrize(
    "options",
    [["--seed", "0"], ["--index", "x.json"], ["--no-shuffle-shards"], ["--remainder", "drop"]],
)
@pytest.mark.parametrize("split", [[], ["--split", "none"]])
def test_dataset_options_need_split_dataset(options, split, tmp_path, cache_dir, capsys) -> None:
    code, stdout, stderr = _cli(capsys, "warm", str(tmp_path / "x.tar"), *split, *options)
    assert code == 2
    assert stderr.startswith(f"shardcache warm: error: {options[0]}: only with --split dataset")
    assert stdout == ""


def test_warm_split_dataset_with_an_index_of_another_list_fails(
    indexed, tmp_path, cache_dir, capsys
) -> None:
    spec, urls, index = indexed
    extra = tmp_path / "extra.tar"
    extra.write_bytes(tar_bytes(shard_samples(99, 2)))
    argv = ["warm", spec, str(extra), "--split", "dataset", "--index", index]
    code, stdout, stderr = _cli(capsys, *argv)
    assert code == 1
    assert stderr.startswith("shardcache: SampleIndexError: the sample index ")
    assert "does not cover this shard list: 1 of" in stderr and "shardcache index" in stderr
    assert stdout == ""
    assert _cached(ShardCache(cache_dir), [*urls, str(extra)]) == []
