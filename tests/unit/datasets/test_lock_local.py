"""The dataset lockfile over local shards: the document and its digest, the first writer
winning, a changed local shard named (no version to read back), the warn choice, the
lock's digest in every state (DataLoader workers, job states, a mixture's sources)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tars import shard_samples, tar_bytes
from torchdata.stateful_dataloader import StatefulDataLoader

from shardcache import (
    ConfigError,
    DatasetChangedError,
    MixtureDataset,
    ResumableDataset,
    ShardCache,
    Source,
    job_state,
)
from shardcache._datasets.dataset_lock import (
    DatasetLock,
    ShardIdentity,
    changes,
    read_lock,
    write_lock,
)

pytestmark = pytest.mark.timeout(120)
PER_SHARD = 5


def _shards(root: Path, count: int, first: int = 0) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    urls = []
    for shard in range(first, first + count):
        path = root / f"{shard:04d}.tar"
        path.write_bytes(tar_bytes(shard_samples(shard, PER_SHARD, size=8)))
        urls.append(str(path))
    return urls


def _rewrite(url: str) -> None:
    """Other bytes of the same keys and sizes, a later modification time."""
    path = Path(url)
    data = path.read_bytes()
    shard = int(path.stem)
    samples = [
        (key, {"bin": b"\xff" * 8, "cls": files["cls"]})
        for key, files in shard_samples(shard, PER_SHARD, size=8)
    ]
    path.write_bytes(tar_bytes(samples))
    assert path.read_bytes() != data and len(path.read_bytes()) == len(data)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_identities_differ_only_in_what_both_sides_know() -> None:
    a = ShardIdentity(10, "e1", "v1", "crc64nvme:AA==")
    assert a.differs(ShardIdentity(10, "e1", "v2", "crc64nvme:AA==")) == []  # a new version
    assert a.differs(ShardIdentity(10, None, None, None)) == []
    assert a.differs(ShardIdentity(11, "e2", "v1", "crc64nvme:AB==")) == [
        "size",
        "etag",
        "checksum",
    ]
    lock = DatasetLock({"s3://b/x": a, "s3://b/y": a})
    found = changes(lock, {"s3://b/x": ShardIdentity(10, "e2"), "s3://b/y": None})
    assert [(c.url, c.fields, c.seen) for c in found] == [
        ("s3://b/x", ("etag",), ShardIdentity(10, "e2")),
        ("s3://b/y", (), None),
    ]
    assert "gone from the store" in found[1].line()


def test_the_document_round_trips_and_an_edited_one_is_refused(tmp_path: Path) -> None:
    lock = DatasetLock(
        {"s3://b/x": ShardIdentity(3, "e", "v", "md5:ab-2"), "/d/y": ShardIdentity(4, None)}
    )
    path = tmp_path / "l.json"
    write_lock(str(path), lock)
    assert read_lock(str(path)) == lock
    assert read_lock(str(tmp_path / "none.json")) is None
    document = json.loads(path.read_text())
    document["shards"][0]["etag"] = "other"
    path.write_text(json.dumps(document))
    with pytest.raises(ConfigError, match="edited or damaged"):
        read_lock(str(path))


def test_the_first_writer_of_a_lockfile_wins(tmp_path: Path) -> None:
    first = DatasetLock({"/d/x": ShardIdentity(1)})
    second = DatasetLock({"/d/x": ShardIdentity(2)})
    path = str(tmp_path / "l.json")
    assert write_lock(path, first, exclusive=True) == first
    assert write_lock(path, second, exclusive=True) == first
    assert read_lock(path) == first
    assert [p.name for p in tmp_path.iterdir()] == ["l.json"]  # no temp file left


def _dataset(urls: list[str], tmp_path: Path, lock: Path, **options) -> ResumableDataset:
    options = {"seed": 3, "rank": 0, "world_size": 1, **options}
    return ResumableDataset(
        urls, cache=ShardCache(tmp_path / "cache"), threads=1, lock=str(lock), **options
    )


def test_a_changed_local_shard_is_named_and_warn_reads_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    urls = _shards(tmp_path / "d", 10)
    lock = tmp_path / "d.lock.json"
    dataset = _dataset(urls, tmp_path, lock)
    iterator = iter(dataset)
    before = [next(iterator)["__key__"] for _ in range(7)]
    state = json.loads(json.dumps(dataset.state_dict()))
    assert state["lock"] == {"digest": read_lock(str(lock)).digest, "location": str(lock)}  # type: ignore[union-attr]
    _rewrite(urls[4])
    resumed = _dataset(urls, tmp_path, lock)
    resumed.load_state_dict(state)
    with pytest.raises(DatasetChangedError) as caught:
        next(iter(resumed))
    assert caught.value.changed == [urls[4]]
    assert caught.value.expected[0]["mtime_ns"] < caught.value.seen[0]["mtime_ns"]
    warned = _dataset(urls, tmp_path, lock, shards_changed="warn")
    warned.load_state_dict(state)
    rest = [sample["__key__"] for sample in warned]
    assert sorted(before + rest) == sorted(
        key for s in range(10) for key, _ in shard_samples(s, PER_SHARD)
    )
    assert any(urls[4] in r.getMessage() and "warn" in r.getMessage() for r in caplog.records)


def test_shards_changed_defaults_to_the_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    urls = _shards(tmp_path / "d", 3)
    lock = tmp_path / "d.lock.json"
    _dataset(urls, tmp_path, lock).prepare()
    _rewrite(urls[1])
    monkeypatch.setenv("SHARDCACHE_SHARDS_CHANGED", "warn")
    assert len(list(_dataset(urls, tmp_path, lock))) == 3 * PER_SHARD
    with pytest.raises(DatasetChangedError):  # the argument wins
        _dataset(urls, tmp_path, lock, shards_changed="error").prepare()
    monkeypatch.setenv("SHARDCACHE_SHARDS_CHANGED", "maybe")
    with pytest.raises(ConfigError, match="SHARDCACHE_SHARDS_CHANGED"):
        _dataset(urls, tmp_path, lock).prepare()


def test_bad_lock_arguments_are_config_errors(tmp_path: Path) -> None:
    urls = _shards(tmp_path / "d", 2)
    with pytest.raises(ConfigError, match="shards_changed='maybe'"):
        _dataset(urls, tmp_path, tmp_path / "l.json", shards_changed="maybe")
    other = tmp_path / "other.json"
    write_lock(str(other), DatasetLock({urls[0]: ShardIdentity(1)}))
    with pytest.raises(ConfigError, match="no entry for 1 of the 2 shards"):
        _dataset(urls, tmp_path, other).prepare()


def test_worker_states_carry_the_lock_and_resume_under_it(tmp_path: Path) -> None:
    urls = _shards(tmp_path / "d", 8)
    lock = tmp_path / "d.lock.json"
    dataset = _dataset(urls, tmp_path, lock).prepare()
    loader = StatefulDataLoader(dataset, batch_size=4, num_workers=2, collate_fn=list)
    iterator = iter(loader)
    first = [s["__key__"] for _ in range(3) for s in next(iterator)]
    state = json.loads(json.dumps(loader.state_dict()))
    digest = read_lock(str(lock)).digest  # type: ignore[union-attr]
    gathered = job_state(state)
    assert {part["lock"]["digest"] for part in gathered["parts"]} == {digest}
    again = _dataset(urls, tmp_path, lock, world_size=1).prepare()
    again.load_state_dict(gathered)
    rest = [s["__key__"] for s in again]
    assert sorted(first + rest) == sorted(
        key for s in range(8) for key, _ in shard_samples(s, PER_SHARD)
    )


def test_a_mixture_source_with_a_lock_names_itself_when_its_shards_changed(
    tmp_path: Path,
) -> None:
    web, code = _shards(tmp_path / "web", 4), _shards(tmp_path / "code", 2, first=10)
    lock = tmp_path / "code.lock.json"

    def mixture() -> MixtureDataset:
        return MixtureDataset(
            [
                Source(web, weight=0.6, name="web"),
                Source(code, weight=0.4, name="code", lock=str(lock)),
            ],
            epoch_size=20,
            cache=ShardCache(tmp_path / "cache"),
            threads=1,
            rank=0,
            world_size=1,
        )

    dataset = mixture()
    iterator = iter(dataset)
    for _ in range(5):
        next(iterator)
    state = json.loads(json.dumps(dataset.state_dict()))
    _rewrite(code[1])
    resumed = mixture()
    resumed.load_state_dict(state)
    with pytest.raises(DatasetChangedError, match="source 'code'") as caught:
        next(iter(resumed))
    assert caught.value.changed == [code[1]]
