"""An Azure Blob Storage server on loopback: Azurite's blob service in a child process.

adlfs reaches it with the development account's connection string::

    with AzuriteServer() as azure:
        azure.put_objects("ctr", {"a.tar": b"..."})
        fs = adlfs.AzureBlobFileSystem(**azure.storage_options())

Blobs written in one request carry Content-MD5, and Azurite honours ``If-Match`` on ranged
reads, as Azure does. Azurite is a node program: ``scripts/setup-azurite`` installs it with npm
under the venv (``<venv>/azurite``); one on PATH (``azurite-blob``) is used otherwise.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardcache.testing._child_server import ChildServer
from shardcache.testing._service import HOST

ACCOUNT = "devstoreaccount1"
# Azurite's well-known development account key, published with Azurite (not a secret).
ACCOUNT_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def azurite_program() -> str | None:
    """``azurite-blob`` installed under this venv by scripts/setup-venv, else on PATH."""
    beside = Path(sys.prefix) / "azurite" / "node_modules" / ".bin" / "azurite-blob"
    return str(beside) if beside.is_file() else shutil.which("azurite-blob")


class AzuriteServer(ChildServer):
    """``azurite-blob`` on 127.0.0.1 (a free port), its data in a temporary directory."""

    program_name = "azurite-blob"
    # On SIGTERM Azurite waits for its clients' keep-alive connections to close (seconds);
    # its data is thrown away anyway.
    graceful = False
    install_hint = (
        "run scripts/setup-azurite (it installs Azurite with npm under the venv), or "
        "npm install -g azurite@3.37.0"
    )

    def program(self) -> str | None:
        """The executable (:func:`azurite_program`), None when it is not installed."""
        return azurite_program()

    def _command(self, program: str, port: int) -> list[str]:
        return [
            program,
            "--blobHost",
            HOST,
            "--blobPort",
            str(port),
            "--location",
            str(self.state / "data"),
            "--loose",
            "--skipApiVersionCheck",
        ]

    def connection_string(self, endpoint_url: str | None = None, key: str = ACCOUNT_KEY) -> str:
        """The development account's connection string; ``endpoint_url`` for a proxy."""
        return (
            f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint_url or self.endpoint_url}/{ACCOUNT};"
        )

    def storage_options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """``storage_options`` for adlfs; pass ``endpoint_url`` to go through a proxy."""
        return {"connection_string": self.connection_string(endpoint_url)}

    def service_client(self) -> Any:
        """A (synchronous) ``BlobServiceClient`` of this server."""
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def reset(self) -> None:
        """Remove every container and blob."""
        client = self.service_client()
        for container in client.list_containers():
            client.delete_container(container.name)

    def put_objects(self, container: str, objects: Mapping[str, bytes]) -> dict[str, str]:
        """Store ``objects`` in ``container`` (made if missing), each in one request (so
        with Content-MD5); returns name -> ETag."""
        client = self.service_client().get_container_client(container)
        if not client.exists():
            client.create_container()
        etags = {}
        for name, data in objects.items():
            blob = client.upload_blob(name, data, overwrite=True)
            etags[name] = str(blob.get_blob_properties().etag).strip('"')
        return etags
