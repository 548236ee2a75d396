"""Test and demo infrastructure: a real S3 server (moto) on loopback and a fault proxy.

Needs the ``test`` extra (moto[server], boto3).
"""

from shardcache.testing.faultproxy import (
    FaultProxy,
    FaultRule,
    FaultRules,
    InjectedFault,
    ProxyStats,
)
from shardcache.testing.s3server import Request, S3Server

__all__ = [
    "FaultProxy",
    "FaultRule",
    "FaultRules",
    "InjectedFault",
    "ProxyStats",
    "Request",
    "S3Server",
]
