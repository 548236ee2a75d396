"""A GCS server on loopback: ``gcp-storage-emulator`` in a child process, in memory.

gcsfs reaches it with ``token="anon"`` and its ``endpoint_url``::

    with GcsEmulator() as gcs:
        gcs.put_objects("bkt", {"a.tar": b"..."})
        fs = gcsfs.GCSFileSystem(**gcs.storage_options())

Objects carry ``crc32c``, ``md5Hash`` and a generation as on GCS. The emulator ignores a
read's ``generation`` (it serves the current object) and sends no ``x-goog-generation``.
The program comes from the ``gcp-storage-emulator`` package (the ``testing`` extra).
"""

from __future__ import annotations

import http.client
from collections.abc import Mapping
from typing import Any

from shardcache.testing._child_server import ChildServer
from shardcache.testing._service import HOST


class GcsEmulator(ChildServer):
    """``gcp-storage-emulator start --in-memory`` on 127.0.0.1 (a free port)."""

    program_name = "gcp-storage-emulator"

    def _command(self, program: str, port: int) -> list[str]:
        return [program, "start", f"--host={HOST}", f"--port={port}", "--in-memory"]

    def storage_options(self, endpoint_url: str | None = None) -> dict[str, Any]:
        """``storage_options`` for gcsfs; pass ``endpoint_url`` to go through a proxy."""
        return {"token": "anon", "endpoint_url": endpoint_url or self.endpoint_url}

    def filesystem(self) -> Any:
        """A gcsfs file system of this server (the plain one: no bucket-type look-ups)."""
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(**self.storage_options(), skip_instance_cache=True)

    def reset(self) -> None:
        """Remove every bucket and object."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=10.0)
        try:
            conn.request("GET", "/wipe")
            response = conn.getresponse()
            response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"{self.program_name}: /wipe answered {response.status}")

    def put_objects(self, bucket: str, objects: Mapping[str, bytes]) -> dict[str, str]:
        """Store ``objects`` in ``bucket`` (made if missing); returns key -> generation."""
        fs = self.filesystem()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        generations = {}
        for key, data in objects.items():
            fs.pipe_file(f"{bucket}/{key}", data)
            generations[key] = str(fs.info(f"{bucket}/{key}")["generation"])
        return generations
