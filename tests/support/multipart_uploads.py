"""Multipart uploads as real buckets hold them: parts of given sizes (regular or not), with
or without an additional checksum, through any S3 server's boto3 client."""

from __future__ import annotations

from typing import Any


def regular_sizes(total: int, part: int) -> list[int]:
    """Parts of ``part`` bytes, the last one the rest (as boto3, the AWS CLI and s3fs cut)."""
    return [min(part, total - start) for start in range(0, total, part)]


def upload_in_parts(
    client: Any,
    bucket: str,
    key: str,
    data: bytes,
    sizes: list[int],
    *,
    algorithm: str | None = None,
    checksum_type: str | None = None,
) -> dict[str, Any]:
    """Upload ``data`` as a multipart upload of parts of ``sizes`` bytes; ``algorithm``
    (``CRC32``, ``CRC32C``, ``SHA1``, ``SHA256``, ``CRC64NVME``) adds an additional checksum
    of ``checksum_type`` (the store's default kind when None). Without ``algorithm`` the
    client must not add one of its own (``request_checksum_calculation="when_required"``).
    Returns the ``CompleteMultipartUpload`` answer."""
    if sum(sizes) != len(data):
        raise ValueError(f"part sizes add up to {sum(sizes)}, the data has {len(data)} bytes")
    create: dict[str, Any] = {}
    if algorithm is not None:
        create["ChecksumAlgorithm"] = algorithm
    if checksum_type is not None:
        create["ChecksumType"] = checksum_type
    upload = client.create_multipart_upload(Bucket=bucket, Key=key, **create)["UploadId"]
    parts, offset = [], 0
    for number, size in enumerate(sizes, start=1):
        extra = {"ChecksumAlgorithm": algorithm} if algorithm is not None else {}
        answer = client.upload_part(
            Bucket=bucket,
            Key=key,
            UploadId=upload,
            PartNumber=number,
            Body=data[offset : offset + size],
            **extra,
        )
        offset += size
        parts.append(
            {"PartNumber": number, "ETag": answer["ETag"]}
            | {k: v for k, v in answer.items() if k.startswith("Checksum") and k != "ChecksumType"}
        )
    return client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}
    )
