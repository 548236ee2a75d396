"""The ``shardcache`` command's conveniences, run as a user runs them (``python -m
shardcache``) over local shard files: ``warm --dry-run``/``--list`` (this task's share,
nothing read), ``evict --dry-run`` (what would go, nothing removed, sizes in the units
given), ``status --list`` (each cached shard), "did you mean" for a mistyped command or
choice, ``verify --quick`` (no rate for bytes it never read) and a mistyped ``SHARDCACHE_``
variable warned of once, not once per DataLoader worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tars import shard_samples, tar_bytes
from test_cli import _run  # python -m shardcache ARGS, SHARDCACHE_DIR=<tmp_path>/cache

from shardcache import ResumableDataset, ShardCache
from shardcache._cli.main import main

pytestmark = pytest.mark.timeout(120)
COUNTS = (12, 9, 11, 5, 8, 7)


@pytest.fixture
def urls(tmp_path: Path) -> list[str]:
    made = []
    for shard, count in enumerate(COUNTS):
        path = tmp_path / "data" / f"train-{shard}.tar"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(tar_bytes(shard_samples(shard, count, size=1000)))
        made.append(str(path))
    return made


def _spec(tmp_path: Path) -> str:
    return str(tmp_path / "data" / f"train-{{0..{len(COUNTS) - 1}}}.tar")


def test_warm_dry_run_lists_this_ranks_share_and_reads_nothing(tmp_path: Path, urls) -> None:
    ranks = {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"}
    listed = _run(tmp_path, "warm", _spec(tmp_path), "--dry-run", **ranks)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == urls[1::3]  # what shardcache.split_by_node gives it
    assert listed.stderr.startswith("warm --dry-run: 2 shards (rank 1 of 3")
    assert not (tmp_path / "cache").exists()  # nothing fetched, no cache made
    as_json = json.loads(_run(tmp_path, "warm", _spec(tmp_path), "--list", "--json").stdout)
    assert (as_json["dry_run"], as_json["urls"]) == (True, urls)
    idle = _run(tmp_path, "warm", _spec(tmp_path), "--dry-run", **ranks, SHARDCACHE_SCOPE="node")
    assert idle.returncode == 0 and idle.stdout == ""  # local rank 0 warms the node's
    assert "warm --dry-run: 0 shards (local rank 1;" in idle.stderr
    assert not (tmp_path / "cache").exists()


def test_warm_dry_run_of_split_dataset_lists_the_datasets_cache_urls(tmp_path: Path, urls) -> None:
    index = tmp_path / "train.index.json"
    made = _run(tmp_path, "index", _spec(tmp_path), "-o", str(index))
    assert made.returncode == 0, made.stderr
    cache_dir = tmp_path / "elsewhere"
    ranks = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    args = ["--split", "dataset", "--index", str(index), "--seed", "7", "--cache-dir"]
    listed = _run(tmp_path, "warm", _spec(tmp_path), "--dry-run", *args, str(cache_dir), **ranks)
    assert listed.returncode == 0, listed.stderr
    dataset = ResumableDataset(
        urls, seed=7, index=str(index), rank=1, world_size=2, cache=ShardCache(cache_dir)
    )
    expected = dataset.cache_urls()
    assert listed.stdout.splitlines() == expected and 0 < len(expected) < len(urls)
    data = cache_dir / "rank-1" / "data"
    assert not data.exists() or not any(data.rglob("*.tar*"))  # no shard fetched


def test_evict_dry_run_lists_what_would_go_and_removes_nothing(tmp_path: Path, urls) -> None:
    cache = ShardCache(tmp_path / "cache")
    for url in urls:
        cache.fetch(url)
    entries = cache.entries()
    sizes = sum(e.size for e in entries)
    limit = sizes - entries[0].size - entries[1].size  # the two least recently used go
    dry = _run(tmp_path, "evict", "--max-bytes", str(limit), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    report = json.loads(dry.stdout)
    assert report["dry_run"] is True
    assert [item["path"] for item in report["removed"]] == [str(e.path) for e in entries[:2]]
    assert cache.entries() == entries  # nothing removed
    real = json.loads(_run(tmp_path, "evict", "--max-bytes", str(limit), "--json").stdout)
    assert [i["path"] for i in real["removed"]] == [i["path"] for i in report["removed"]]
    assert len(cache.entries()) == len(entries) - 2

    text = _run(tmp_path, "evict", "--max-bytes", "30M", "-n")  # sizes as given: decimal
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(
        f"evict {cache.settings.scope_dir} to 30.0 MB (30000000 bytes): would remove 0 shards"
    )
    assert "--dry-run: nothing removed" in text.stdout
    binary = _run(tmp_path, "evict", "--max-bytes", "1KiB", "--dry-run")
    assert "to 1.0 KB (1024 bytes): would remove 4 shards" in binary.stdout
    assert len(cache.entries()) == len(entries) - 2


def test_status_list_shows_every_cached_shard(tmp_path: Path, urls) -> None:
    cache = ShardCache(tmp_path / "cache")
    for url in urls[:3]:
        cache.fetch(url)
    shown = _run(tmp_path, "status", "--list")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("entries     3 shards")))
    listed = lines[at + 1 : at + 4]
    assert [line.split(" (")[0].strip() for line in listed] == [f"file://{u}" for u in urls[:3]]
    assert all("KB, last used 20" in line for line in listed)
    as_json = json.loads(_run(tmp_path, "status", "--list", "--json").stdout)
    assert [s["url"] for s in as_json["shards"]] == [f"file://{u}" for u in urls[:3]]
    assert {s["size"] for s in as_json["shards"]} == {e.size for e in cache.entries()}
    assert "shards" not in json.loads(_run(tmp_path, "status", "--json").stdout)
    every = _run(tmp_path, "status", "--all", "--list")
    assert sum(line.startswith("rank-0: ") for line in every.stdout.splitlines()) >= 3


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["wram", "s3://b/x.tar"], "unknown command 'wram': did you mean 'warm'?"),
        (["stauts"], "unknown command 'stauts': did you mean 'status'?"),
        (["evcit"], "did you mean 'evict'?"),
        (["status", "--scope", "nod"], "invalid choice: 'nod': did you mean 'node'?"),
        (["warm", "x.tar", "--split", "datset"], "did you mean 'dataset'?"),
    ],
)
def test_a_mistyped_command_or_choice_gets_the_closest_one(argv, said, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err and len(err.splitlines()) == 1


def test_nothing_close_names_no_command(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["xyzzy"])
    err = capsys.readouterr().err
    assert "unknown command 'xyzzy': (commands: config, demo, warm" in err
    assert "did you mean" not in err


def test_verify_quick_reports_no_rate_of_bytes_it_did_not_read(tmp_path: Path, urls) -> None:
    cache = ShardCache(tmp_path / "cache")
    for url in urls:
        cache.fetch(url)
    quick = _run(tmp_path, "verify", "--quick")
    assert quick.returncode == 0, quick.stderr
    (last,) = [line for line in quick.stderr.splitlines() if line.startswith("verify: 6/6")]
    assert "MB/s" not in last and "checked" not in last and last.endswith(", done")
    full = _run(tmp_path, "verify")  # reads every shard: bytes and rate shown
    (line,) = [line for line in full.stderr.splitlines() if line.startswith("verify: 6/6")]
    assert " checked, " in line and "MB/s" in line


LOADER = """
import logging, sys
import torch.utils.data
import shardcache
logging.basicConfig(level=logging.WARNING, format="%(processName)s %(message)s")
dataset = shardcache.ResumableDataset(sys.argv[1:], rank=0, world_size=1, threads=1)
loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, timeout=60)
print(sum(1 for _ in loader))
"""


def test_a_mistyped_variable_is_warned_once_not_once_per_dataloader_worker(
    tmp_path: Path, urls
) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", LOADER, *urls],
        env={**os.environ, "SHARDCACHE_DIR": str(tmp_path / "cache"), "SHARDCACHE_THRAEDS": "8"},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert int(ran.stdout) == sum(COUNTS)
    warned = [line for line in ran.stderr.splitlines() if "SHARDCACHE_THRAEDS" in line]
    assert len(warned) == 1 and warned[0].startswith("MainProcess "), ran.stderr
