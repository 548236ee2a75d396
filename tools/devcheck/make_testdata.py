"""Stand-ins for webdataset's test files that its repository keeps outside git.

``testdata/imagenet-000000.tgz`` is 47 ImageNet-style samples (``.cls``, ``.png``,
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
            # webdataset's tests check the first image's shape and cut the file at 10 KB.
            ramp = np.linspace(0, 255, 600, dtype=np.uint8)[None, :, None]
            pixels = np.broadcast_to(ramp, (793, 600, 3)) ^ np.uint8(rng.integers(0, 256))
            pixels[:8] = rng.integers(0, 256, size=(8, 600, 3), dtype=np.uint8)  # ~1 MB in all
            png = io.BytesIO()
            Image.fromarray(pixels).save(png, format="PNG")
            members = {
                "cls": b"%d" % (i % 10),
                "png": png.getvalue(),
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
