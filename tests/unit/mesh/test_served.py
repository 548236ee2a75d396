"""Which request reaches which file: the identity a request names is opened only when it is
the canonical one the job allowed, so another spelling of a store's URL never reaches a copy
the check judged under another name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardcache._disk.layout import CacheLayout
from shardcache._disk.metadata import write_meta
from shardcache._mesh.served import NotServed, ServedShards, ShardRequest


def _published(layout: CacheLayout, url: str, protocol: str, data: bytes) -> None:
    path = layout.identify(url, protocol, "gcs").data_path
    layout.make_dir(path.parent)
    fd = layout.fs.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data)
        write_meta(layout, path, {"size": len(data), "data_ino": os.fstat(fd).st_ino})
    finally:
        os.close(fd)


def test_only_the_canonical_spelling_reaches_the_copy(tmp_path: Path) -> None:
    layout = CacheLayout(tmp_path / "cache" / "node")
    _published(layout, "gs://bucket/a.tar", "gs", b"x" * 10)
    assert layout.identify("gcs://bucket/a.tar", "gcs", "gcs").data_path == (
        layout.identify("gs://bucket/a.tar", "gs", "gcs").data_path
    )  # the same file under both spellings
    shards = ServedShards({"node": layout}, lambda url, ns: True)
    served = shards.open(ShardRequest("node", "gs", "gcs", "gs://bucket/a.tar"))
    os.close(served.fd)
    assert served.size == 10
    with pytest.raises(NotServed) as refused:
        shards.open(ShardRequest("node", "gcs", "gcs", "gcs://bucket/a.tar"))
    assert refused.value.status == 404
