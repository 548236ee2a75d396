"""Stand-ins for webdataset's test files that its repository keeps outside git.

``testdata/imagenet-000000.tgz`` is 47 ImageNet-style samples (``.cls``, ``.jpg``,
``.wnid``, ``.xml``), gzipped: the counts and keys webdataset's tests assert on, with
generated images. Run with the webdataset source tree as the argument.
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

SAMPLES = 47


def imagenet_shard() -> bytes:
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for i in range(SAMPLES):
            key = f"n01440764_{10026 + i}"
            pixels = rng.integers(0, 256, size=(96, 128, 3), dtype=np.uint8)
            jpg = io.BytesIO()
            Image.fromarray(pixels).save(jpg, format="JPEG", quality=90)
            members = {
                "cls": b"%d" % (i % 10),
                "jpg": jpg.getvalue(),
                "wnid": b"n01440764",
                "xml": b"<annotation><filename>%s</filename></annotation>" % key.encode(),
            }
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime, info.mode = len(data), 0, 0o644
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


if __name__ == "__main__":
    target = Path(sys.argv[1]) / "testdata" / "imagenet-000000.tgz"
    if not target.exists():
        target.write_bytes(imagenet_shard())
        print(f"wrote {target} ({target.stat().st_size} bytes)")
