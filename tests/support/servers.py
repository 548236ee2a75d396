"""The S3 servers a test can run on, by name: ``moto`` (the default of the ``s3`` fixture)
and ``seaweedfs`` (a production object store, ``weed server -s3``).

``@on_s3_servers`` runs a test that uses the ``s3`` fixture (directly or through another
fixture) once per server; ``fault_proxy`` then sits in front of that server.
"""

from __future__ import annotations

import pytest

S3_SERVERS = ("moto", "seaweedfs")

on_s3_servers = pytest.mark.parametrize("s3", S3_SERVERS, indirect=True)
