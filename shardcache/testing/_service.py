"""The surface shared by the loopback servers used in tests and the demo."""

from __future__ import annotations

import abc
import socket
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

HOST = "127.0.0.1"
REGION = "us-east-1"
_S = TypeVar("_S", bound="LoopbackService")


def free_port() -> int:
    """A port nothing listens on now on 127.0.0.1 (another process may take it before a
    server binds it: servers retry on another)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


class LoopbackService(abc.ABC):
    """A server on 127.0.0.1 (or ``_host``): ``port``/``endpoint_url`` once started; a
    context manager.

    Subclasses set ``self._port`` when listening and implement ``start``/``stop``.
    """

    _port: int | None = None
    _host: str = HOST

    @abc.abstractmethod
    def start(self: _S) -> _S:
        """Start listening and return self once ready."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop and release every socket and thread (idempotent)."""

    @property
    def port(self) -> int:
        """The listening port (only valid once started)."""
        if self._port is None:
            raise RuntimeError(f"{type(self).__name__} is not running; call start() first")
        return self._port

    @property
    def endpoint_url(self) -> str:
        """``http://127.0.0.1:PORT`` (or the address it listens on)."""
        return f"http://{self._host}:{self.port}"

    def __enter__(self: _S) -> _S:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class S3Service(LoopbackService):
    """A loopback S3 server: the client configuration that reaches it with its keys
    (``access_key``, ``secret_key``), directly or through a proxy's ``endpoint_url``."""

    access_key: str
    secret_key: str

    def env(self, endpoint_url: str | None = None) -> dict[str, str]:
        """AWS_* variables that point boto3/s3fs (``fsspec.filesystem("s3")``) here."""
        return {
            "AWS_ENDPOINT_URL": endpoint_url or self.endpoint_url,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def storage_options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """``storage_options`` for s3fs; pass ``endpoint_url`` to go through a proxy."""
        return {
            "endpoint_url": endpoint_url or self.endpoint_url,
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"region_name": REGION},
        }

    def boto3_client(self, endpoint_url: str | None = None, **config_kwargs: Any) -> Any:
        """A boto3 S3 client for this server; ``config_kwargs`` go to ``botocore.Config``."""
        import boto3
        from botocore.config import Config

        config_kwargs.setdefault("s3", {"addressing_style": "path"})
        return boto3.client(
            "s3",
            endpoint_url=endpoint_url or self.endpoint_url,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
            config=Config(**config_kwargs),
        )


def upload_multipart(
    client: Any,
    bucket: str,
    key: str,
    data: bytes,
    part_size: int | Sequence[int],
    *,
    checksum: str | None = None,
    checksum_type: str | None = None,
) -> dict[str, Any]:
    """Upload ``data`` with ``client`` as a multipart upload of ``part_size`` parts (the
    last one shorter; one empty part for no data), or of parts of the sizes ``part_size``
    lists (uploads whose parts differ); returns CompleteMultipartUpload's answer (``ETag``,
    and ``Checksum*`` when the store keeps one).

    ``checksum`` (``"CRC32"``, ``"CRC32C"``, ``"CRC64NVME"``, ``"SHA1"``, ``"SHA256"``) is
    sent with every part and the parts' values with the completion; ``checksum_type``
    (``"COMPOSITE"``, ``"FULL_OBJECT"``; default the store's for the algorithm) is asked
    for at creation. Without ``checksum`` parts carry only what ``client`` adds itself (a
    client made with ``request_checksum_calculation="when_required"`` adds nothing)."""
    spans = _part_spans(len(data), part_size)
    create: dict[str, Any] = {}
    if checksum is not None:
        create["ChecksumAlgorithm"] = checksum
    if checksum_type is not None:
        create["ChecksumType"] = checksum_type
    upload = client.create_multipart_upload(Bucket=bucket, Key=key, **create)["UploadId"]
    parts = []
    for number, (start, end) in enumerate(spans, start=1):
        extra = {} if checksum is None else {"ChecksumAlgorithm": checksum}
        answer = client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            PartNumber=number,
            Body=data[start:end],
            **extra,
        )
        part = {"PartNumber": number, "ETag": answer["ETag"]}
        if checksum is not None:
            name = f"Checksum{checksum.upper()}"
            part[name] = answer[name]
        parts.append(part)
    answer = client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
    )
    return {k: v for k, v in answer.items() if k != "ResponseMetadata"}


def _part_spans(total: int, part_size: int | Sequence[int]) -> list[tuple[int, int]]:
    """Each part's ``[start, end)``: of ``part_size`` bytes (the last one the rest), or of
    the sizes listed (adding up to ``total``)."""
    if isinstance(part_size, int):
        if part_size <= 0:
            raise ValueError(f"part_size must be positive, got {part_size}")
        sizes = [min(part_size, total - start) for start in range(0, total, part_size)] or [0]
    else:
        sizes = list(part_size)
        if sum(sizes) != total or not sizes or min(sizes) < 0:
            raise ValueError(f"part sizes {sizes} do not cut {total} bytes into parts")
    spans, start = [], 0
    for size in sizes:
        spans.append((start, start + size))
        start += size
    return spans
