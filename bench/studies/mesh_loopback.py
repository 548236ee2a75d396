"""Cache mesh on loopback: one peer process serves a published shard (fetched from moto by a
real ShardCache), this process fetches it whole, again and again; throughput, and CPU per GB
on the serving side (the peer process's user + system time from /proc) and the receiving
side (this process's), with the received bytes discarded or written to a file.

    python bench/studies/mesh_loopback.py [--size-mib 256] [--runs 5] [--no-sendfile]

``--no-sendfile`` makes the peer's event loop copy through Python (asyncio's own fallback, as
where the kernel's sendfile is unavailable): what the zero-copy path saves.

Prints one JSON object. Loopback has no link limit: the figures bound what the two
processes cost, not what a network gives.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BUCKET, KEY, JOB = "meshbench", "big.tar", "bench"
SECRET = bytes(range(32))
TICKS = os.sysconf("SC_CLK_TCK")


def _serve(root: str, url: str, namespace: str, mode: str) -> None:
    """The peer: serve the node cache at ``root`` until stdin closes."""
    import asyncio.unix_events

    loop_class = asyncio.unix_events._UnixSelectorEventLoop
    if mode == "copy":

        async def unavailable(*args: object) -> None:
            raise asyncio.SendfileNotAvailableError("bench: --no-sendfile")

        loop_class._sendfile_native = unavailable  # type: ignore[method-assign]
    calls = [0]
    real_sendfile = os.sendfile

    def counted(*args: int) -> int:
        calls[0] += 1
        return real_sendfile(*args)

    os.sendfile = counted  # the kernel calls made, printed at the end
    from shardcache._disk.layout import CacheLayout, scope_dir
    from shardcache._mesh.auth import JobKey, Verifier
    from shardcache._mesh.served import ServedShards
    from shardcache._mesh.server import MeshServer

    layout = CacheLayout(scope_dir(root, "node", 0))
    shards = ServedShards({"node": layout}, lambda u, ns: (u, ns) == (url, namespace))
    with MeshServer(shards, Verifier(JobKey(SECRET, JOB)), "127.0.0.1") as server:
        print(server.port, flush=True)
        sys.stdin.read()
    print(calls[0], flush=True)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-sendfile", action="store_true")
    parser.add_argument("--serve", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(*args.serve)
        return

    from shardcache import ShardCache
    from shardcache._mesh.auth import JobKey
    from shardcache._mesh.client import Peer, fetch_range
    from shardcache._mesh.served import ShardRequest
    from shardcache.testing import S3Server

    size = args.size_mib << 20
    with S3Server() as s3, tempfile.TemporaryDirectory() as tmp:
        os.environ.update(s3.env())
        s3.put_objects(BUCKET, {KEY: os.urandom(size)})
        cache = ShardCache(Path(tmp) / "cache", scope="node")
        url = f"s3://{BUCKET}/{KEY}"
        cache.fetch(url)
        shard = cache._identify(url)
        request = ShardRequest("node", shard.protocol, shard.namespace, shard.canonical_url)
        peer_args = [sys.executable, __file__, "--serve", str(cache.layout.root), request.url]
        peer_args += [request.namespace, "copy" if args.no_sendfile else "sendfile"]
        proc = subprocess.Popen(peer_args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None
            peer = Peer("127.0.0.1", int(proc.stdout.readline()))
            rows = {sink: [] for sink in ("discard", "write")}
            for _ in range(args.runs):
                for sink_name, rows_of in rows.items():
                    out = Path(tmp) / "received"
                    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    sink = (
                        (lambda piece: None)
                        if sink_name == "discard"
                        else (lambda piece, fd=fd: os.write(fd, piece))
                    )
                    served0, own0, wall0 = (
                        _cpu_seconds(proc.pid),
                        time.process_time(),
                        time.perf_counter(),
                    )
                    fetch_range(peer, JobKey(SECRET, JOB), request, sink)
                    wall = time.perf_counter() - wall0
                    own, served = time.process_time() - own0, _cpu_seconds(proc.pid) - served0
                    os.close(fd)
                    out.unlink()
                    rows_of.append((size / wall / 1e6, served, own))
            assert proc.stdin is not None
            proc.stdin.close()
            sendfile_calls = int(proc.stdout.readline())
        finally:
            proc.kill()
            proc.wait(10)

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    total_gb = size * args.runs / 1e9  # CPU summed over the runs: /proc counts in ticks
    result = {
        "size_mib": args.size_mib,
        "runs": args.runs,
        "sendfile": not args.no_sendfile,
        "os_sendfile_calls_in_the_peer": sendfile_calls,
        "load_average_1min": os.getloadavg()[0],
        **{
            sink: {
                "MB_per_s": round(median([r[0] for r in rows_of]), 1),
                "serving_cpu_s_per_GB": round(sum(r[1] for r in rows_of) / total_gb, 3),
                "receiving_cpu_s_per_GB": round(sum(r[2] for r in rows_of) / total_gb, 3),
            }
            for sink, rows_of in rows.items()
        },
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
