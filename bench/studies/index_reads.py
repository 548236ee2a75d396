"""Learning a shard's sample offsets: one whole GET, or its tar headers by ranged GETs.

    python -m bench.studies.index_reads [--shard-mb 64] [--sample-kb 100,10,1] [--json FILE]

On the moto server (``shardcache.testing.S3Server``, its own process), one shard per sample
size, of samples as webdataset writes them (a ``.bin`` of the sample size and a ``.cls`` of
one byte: two tar members a sample). Three ways to learn the shard's sample offsets, each
with the GETs it sends and the bytes it receives counted, and timed:

* *whole*: one GET of the shard, its headers read from the stream (what shardcache does:
  each cache indexes only shards it reads in every epoch, so the bytes are wanted anyway);
* *headers*: a ranged GET of each 512-byte header; a header gives its member's size, so
  the next header's offset, and nothing else does (a tar has no table of contents);
* *windows*: ranged GETs of 64 KiB, each from the first header not yet read (small
  members share a window).

moto copies the whole object for every ranged GET, so its times overstate the ranged ways
(ENVIRONMENT.md); the *model* column prices each way at a real store's usual figures
instead: 20 ms to the first byte of a GET, 100 MB/s a stream (one reader, no parallelism).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.support.infra import MB, MiB, make_shard, samples_per_shard, table_main
from shardcache.testing import S3Server

BLOCK = 512
WINDOW = 64 * 1024
LATENCY, BANDWIDTH = 0.020, 100 * MB  # the model's store: first byte, one stream
BUCKET = "index-reads"


def member_size(header: bytes) -> int:
    """The size field of a ustar header (octal, NUL/space padded)."""
    return int(header[124:136].rstrip(b"\0 ").decode() or "0", 8)


def next_header(offset: int, size: int) -> int:
    return offset + BLOCK + -(-size // BLOCK) * BLOCK


def whole(get: Callable[..., bytes], key: str) -> list[int]:
    data = get(key)
    offsets, offset = [], 0
    while offset + BLOCK <= len(data) and data[offset : offset + BLOCK].strip(b"\0"):
        offsets.append(offset)
        offset = next_header(offset, member_size(data[offset : offset + BLOCK]))
    return offsets


def headers(get: Callable[..., bytes], key: str, size: int) -> list[int]:
    offsets, offset = [], 0
    while offset + BLOCK <= size:
        header = get(key, offset, BLOCK)
        if not header.strip(b"\0"):
            break
        offsets.append(offset)
        offset = next_header(offset, member_size(header))
    return offsets


def windows(get: Callable[..., bytes], key: str, size: int) -> list[int]:
    offsets, offset = [], 0
    while offset + BLOCK <= size:
        window = get(key, offset, WINDOW)
        at = 0
        while at + BLOCK <= len(window):
            header = window[at : at + BLOCK]
            if not header.strip(b"\0"):
                return offsets
            offsets.append(offset + at)
            at = next_header(at, member_size(header))
        offset += at
    return offsets


def measure(client: Any, key: str, size: int) -> dict[str, dict[str, float]]:
    counts = {"gets": 0, "bytes": 0}

    def get(name: str, start: int | None = None, length: int | None = None) -> bytes:
        extra = {} if start is None else {"Range": f"bytes={start}-{start + length - 1}"}
        body = client.get_object(Bucket=BUCKET, Key=name, **extra)["Body"].read()
        counts["gets"] += 1
        counts["bytes"] += len(body)
        return body

    found: dict[str, dict[str, float]] = {}
    reference: list[int] | None = None
    for name, way in (
        ("whole", lambda: whole(get, key)),
        ("headers", lambda: headers(get, key, size)),
        ("windows", lambda: windows(get, key, size)),
    ):
        counts.update(gets=0, bytes=0)
        started = time.perf_counter()
        offsets = way()
        seconds = time.perf_counter() - started
        if reference is None:
            reference = offsets
        assert offsets == reference, f"{name} found other offsets"
        found[name] = {
            "gets": counts["gets"],
            "bytes": counts["bytes"],
            "seconds": seconds,
            "model_s": counts["gets"] * LATENCY + counts["bytes"] / BANDWIDTH,
        }
    return found


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    with S3Server() as s3:
        client = s3.boto3_client()
        client.create_bucket(Bucket=BUCKET)
        for kb in args.sample_kb:
            data = make_shard(args.shard_mb * MiB, kb * 1024, seed=kb)
            key = f"shard-{kb}k.tar"
            client.put_object(Bucket=BUCKET, Key=key, Body=data)
            rows.append(
                {
                    "shard_bytes": len(data),
                    "sample_kb": kb,
                    "samples": samples_per_shard(args.shard_mb * MiB, kb * 1024),
                    **measure(client, key, len(data)),
                }
            )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The figures as a table; the moto column only where the times were kept."""
    timed = all("seconds" in row[way] for row in rows for way in WAYS)
    moto = (" moto s |", "---:|") if timed else ("", "")
    lines = [
        f"| shard | samples | way | GETs | bytes read |{moto[0]} model s |",
        f"|---:|---:|---|---:|---:|{moto[1]}---:|",
    ]
    for row in rows:
        for way in WAYS:
            f = row[way]
            seconds = f" {f['seconds']:.2f} |" if timed else ""
            lines.append(
                f"| {row['shard_bytes'] / MiB:.0f} MiB, {row['sample_kb']} KiB samples | "
                f"{row['samples']:,} | {way} | {f['gets']:,} | {f['bytes'] / MiB:.2f} MiB |"
                f"{seconds} {f['model_s']:.2f} |"
            )
    return "\n".join(lines)


WAYS = ("whole", "headers", "windows")


def main_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shard-mb", type=int, default=64, help="MiB a shard")
    parser.add_argument(
        "--sample-kb",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[100, 10, 1],
        help="sample sizes (KiB), one shard each",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    return table_main(main_parser(), run, table, argv)


if __name__ == "__main__":
    sys.exit(main())
