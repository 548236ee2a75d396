"""Small WebDataset tars for the tests, in any of tarfile's formats, and a stream that reads them
in short pieces."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Sequence

Files = dict[str, bytes]


def tar_bytes(
    samples: Sequence[tuple[str, Files]],
    *,
    tar_format: int = tarfile.USTAR_FORMAT,
    extras: Sequence[tuple[int, str]] = (),
) -> bytes:
    """A tar of ``samples`` (key, {suffix: bytes}); ``extras`` puts a directory or a
    ``__meta__`` member (by name) before sample number ``index``."""
    buf = io.BytesIO()
    before = {index: name for index, name in extras}
    with tarfile.open(fileobj=buf, mode="w", format=tar_format) as tar:
        for index, (key, files) in enumerate(samples):
            if index in before:
                _add(tar, before[index], b"meta", directory=before[index].endswith("/"))
            for suffix, data in files.items():
                _add(tar, f"{key}.{suffix}", data)
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes, *, directory: bool = False) -> None:
    info = tarfile.TarInfo(name.rstrip("/") if directory else name)
    info.mtime, info.mode = 0, 0o755 if directory else 0o644
    if directory:
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    else:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def shard_samples(shard: int, count: int, size: int = 40) -> list[tuple[str, Files]]:
    """``count`` samples of shard ``shard``: keys ``s{shard}_{i}``, a ``.bin`` and a
    ``.cls`` member each."""
    return [
        (f"s{shard:04d}_{i:05d}", {"bin": bytes([i % 251]) * size, "cls": b"%d" % (i % 10)})
        for i in range(count)
    ]


class Chunks(io.BytesIO):
    """A stream that returns at most ``chunk`` bytes a read (as a network stream may)."""

    def __init__(self, data: bytes, chunk: int) -> None:
        super().__init__(data)
        self.chunk = chunk

    def read(self, size: int | None = -1) -> bytes:
        return super().read(self.chunk if size is None or not 0 <= size < self.chunk else size)
